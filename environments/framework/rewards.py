"""Reward functions, and the per-rollout state they score.

An env can declare weighted reward functions instead of writing ``compute_reward`` /
``compute_turn_rewards`` by hand. Each one is called as ``fn(item, rollout, state)``:

* ``item``: the item the rollout was sampled for;
* ``rollout``: the finished :class:`~environments.framework.agent_loop.Rollout` (``messages``,
  ``turns`` with their tool calls, results, errors and spans, ``tokens``, ``stop``...);
* ``state``: a snapshot of the env's *per-rollout state* taken the moment that rollout
  finished (see below); ``None`` for an env that keeps none.

An *outcome* function (the default) returns one float for the whole rollout; a
*per-turn* function (``per_turn=True``) returns one float per assistant turn, in order,
``len(rollout.turns)`` of them, so entry ``k`` is aligned with ``rollout.turns[k]`` and
``turn_spans[k]``. Either may be ``async``. The framework combines them
(:func:`combine_rewards`) into the trajectory's ``scores``, keeps every function's value
in ``trajectory.metadata["rewards"]`` and reports ``reward/NAME`` in its metrics. A
function that raises or returns something unusable fails the rollout (and so drops its
group, counted in ``reward_errors`` and, by function, ``reward_function_errors``): it is
never scored 0.

Per-rollout state
-----------------
``BaseEnv.new_rollout_state(item)`` creates an object for one rollout (a dict, a
dataclass, a handle to a sandbox); tools reach it through :func:`rollout_state` (or get
it as an argument with ``@tool(state_arg="name")``). It is held in a context variable set
for the rollout's own task, so concurrent rollouts each see their own. When the rollout
finishes, ``BaseEnv.snapshot_state(state)`` (default ``copy.deepcopy``) is taken
*synchronously*, before any other coroutine can run, and only that snapshot reaches the
reward functions (and ``rollout.env_state``). So an env that reuses or resets one state
object across rollouts (a pooled sandbox, a cached client) can never have one rollout
scored on another rollout's state, even when scoring is asynchronous and other rollouts
of the group run in between -- the failure mode of env rewards that read a shared env
object after the fact (TRL issue #6027).
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RewardFunction", "combine_rewards", "reward_function", "rollout_state"]

_ROLLOUT_STATE: contextvars.ContextVar[Any] = contextvars.ContextVar("lachesis_rollout_state")
_NO_STATE = object()


def rollout_state(default: Any = _NO_STATE) -> Any:
    """The per-rollout state of the rollout this code runs in (``new_rollout_state``'s
    object), e.g. inside a tool. Outside a rollout: ``default`` if given, else
    ``LookupError``.

    Sync tools run in a worker thread with a copy of the rollout's context, so they see it
    too; several calls of one turn run concurrently and share the object.
    """
    value = _ROLLOUT_STATE.get(_NO_STATE)
    if value is _NO_STATE:
        if default is not _NO_STATE:
            return default
        raise LookupError("rollout_state() called outside a rollout (it is set by "
                          "BaseEnv for the duration of collect_trajectory)")
    return value


def set_rollout_state(state: Any) -> contextvars.Token:
    """Make ``state`` the current rollout's state; undo with :func:`reset_rollout_state`."""
    return _ROLLOUT_STATE.set(state)


def reset_rollout_state(token: contextvars.Token) -> None:
    _ROLLOUT_STATE.reset(token)


@dataclass(frozen=True)
class RewardFunction:
    """A named, weighted reward: ``fn(item, rollout, state)`` -> float (outcome) or one
    float per assistant turn (``per_turn=True``). ``name`` defaults to ``fn.__name__`` and
    is the key in ``metadata["rewards"]`` and the metric ``reward/NAME``.

    Made by :func:`reward_function`, or directly (``RewardFunction(fn, weight=0.5)``).
    Defined in a class body it is a method: ``fn`` then also takes ``self``, and reading
    it from an instance gives the bound function (so ``env.correct(item, rollout, state)``
    works in a test).
    """

    fn: Callable[..., Any]
    weight: float = 1.0
    per_turn: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"reward function {self.fn!r} is not callable")
        if not self.name:
            name = getattr(self.fn, "__name__", None)
            if not name or name == "<lambda>":
                raise TypeError(f"reward function {self.fn!r}: give it a name=")
            object.__setattr__(self, "name", name)
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not math.isfinite(self.weight):
            raise ValueError(f"reward function {self.name!r}: weight must be a finite "
                             f"number, got {self.weight!r}")
        object.__setattr__(self, "weight", float(self.weight))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __get__(self, obj: Any, objtype: type | None = None) -> RewardFunction:
        if obj is None:
            return self
        return dataclasses.replace(self, fn=types.MethodType(self.fn, obj))


def reward_function(fn: Callable[..., Any] | None = None, *, weight: float = 1.0,
                    per_turn: bool = False, name: str | None = None) -> Any:
    """Declare a reward function: ``@reward_function`` or ``@reward_function(weight=0.5,
    per_turn=True, name=...)`` on an env method ``(self, item, rollout, state)`` or on a
    plain function ``(item, rollout, state)`` listed in the env's ``reward_functions``.
    Returns a :class:`RewardFunction`."""
    def build(function: Callable[..., Any]) -> RewardFunction:
        return RewardFunction(function, weight=weight, per_turn=per_turn, name=name or "")

    return build if fn is None else build(fn)


def env_reward_functions(env: Any) -> list[RewardFunction]:
    """The reward functions of an env instance: its class's ``reward_functions`` list, then
    the ones defined in class bodies, bound to ``env`` (base classes first, in definition
    order; a subclass attribute of the same name replaces one, or removes it if it is not
    a reward function). Raises ``TypeError`` on two functions with the same name."""
    cls = type(env)
    listed = list(getattr(cls, "reward_functions", None) or [])
    for entry in listed:
        if not isinstance(entry, RewardFunction):
            raise TypeError(f"{cls.__name__}.reward_functions: {entry!r} is not a "
                            "RewardFunction (decorate it with @reward_function)")
    methods: dict[str, RewardFunction] = {}
    for klass in reversed(cls.__mro__):
        for attribute, value in vars(klass).items():
            if isinstance(value, RewardFunction):
                methods[attribute] = value
            elif attribute in methods:
                del methods[attribute]
    found = listed + [method.__get__(env, cls) for method in methods.values()]
    seen: set[str] = set()
    for function in found:
        if function.name in seen:
            raise TypeError(f"{cls.__name__}: two reward functions are named "
                            f"{function.name!r}")
        seen.add(function.name)
    return found


def combine_rewards(values: Mapping[str, float | Sequence[float]],
                    functions: Sequence[RewardFunction], n_turns: int, *,
                    per_turn_scores: bool) -> float | list[float]:
    """The trajectory's ``scores`` from the values of its reward functions.

    With outcome functions ``f_i`` (weights ``w_i``) and per-turn functions ``g_j``
    (weights ``v_j``, values ``g_j[k]`` for turns ``k = 0..K-1``)::

        O   = sum_i w_i f_i                       (outcome)
        T_k = sum_j v_j g_j[k]                    (turn k's own reward)
        scores = [T_0, ..., T_{K-2}, T_{K-1} + O]   if per_turn_scores (a list, K entries)
        scores = O                                  otherwise (a scalar)

    so the last entry is the outcome of the data contract and includes the final turn's
    own reward; GRPO-MR's merged return ``sum_k scores[k]`` is ``O + sum_k T_k``. A list
    needs ``K >= 1`` (``ValueError`` otherwise).
    """
    outcome_fns = [f for f in functions if not f.per_turn]
    turn_fns = [f for f in functions if f.per_turn]
    outcome = math.fsum(f.weight * float(values[f.name]) for f in outcome_fns)
    if not per_turn_scores:
        return outcome
    if n_turns < 1:
        raise ValueError("per-turn scores need at least one assistant turn")
    if turn_fns:
        matrix = np.asarray([values[f.name] for f in turn_fns], dtype=np.float64)  # [J, K]
        weights = np.asarray([f.weight for f in turn_fns], dtype=np.float64)        # [J]
        turns = weights @ matrix                                                  # [K]
    else:
        turns = np.zeros(n_turns)
    turns[-1] += outcome
    return [float(x) for x in turns]


def reward_metrics(values: Mapping[str, float | Sequence[float]]) -> dict[str, float]:
    """``reward/NAME`` per function: an outcome function's value, a per-turn function's
    mean over the rollout's turns."""
    out = {}
    for name, value in values.items():
        if isinstance(value, (list, tuple)):
            out[f"reward/{name}"] = math.fsum(value) / len(value) if value else 0.0
        else:
            out[f"reward/{name}"] = float(value)
    return out
