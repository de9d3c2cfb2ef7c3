"""``BaseEnv``: what a user subclasses to write an environment.

A user overrides a few named hooks::

    setup()                         load data, build tools            (optional)
    get_next_item()                 the next training item            (required)
    prompt_messages(item)           the chat that starts an episode   (required by the default rollout)
    compute_reward(item, rollout)   a float                           (required without the mixin)
    collect_trajectory(item)        one rollout                       (default: the agent loop)
    evaluate()                      metrics on eval items             (default: mean reward etc.)

and, for per-turn rewards, mixes in :class:`TurnLevelRewardMixin` and implements
``compute_turn_rewards(item, rollout) -> list[float]`` (one per assistant turn; the last
is the outcome). Tools are the class attribute ``tools`` (or ``get_tools(item)``).

Instead of the two ``compute_*`` hooks, an env may declare weighted reward functions
(:mod:`environments.framework.rewards`: ``@reward_function(weight=..., per_turn=...)`` methods or a
``reward_functions`` list), which score the rollout together with a snapshot of the env's
per-rollout state::

    new_rollout_state(item)         an object the rollout's tools share   (default: None)
    snapshot_state(state)           what is scored, taken when the rollout
                                    finishes                              (default: deepcopy)

Everything else (group collection, scoring, delivery to the rollout API or a JSONL file,
counters) is done here. A rollout that fails, a reward list of the wrong length, or a
rollout that is not a valid trajectory drops its whole group: it is logged with the item id
and counted (``groups_failed`` / ``reward_errors``, the last few in ``recent_failures``),
never replaced by a made-up score, and the run goes on. Only when
``max_failed_groups_in_a_row`` groups fail one after the other (a broken setup: every group
would fail) does ``process``/``serve`` stop with an error (the CLI exits 1).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import inspect
import logging
import math
import os
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from environments.framework import runner
from environments.framework.agent_loop import (
    describe_turns,
    observation_anchors,
    run_agent_loop,
)
from environments.framework.limits import check_context_limits
from environments.framework.rewards import (
    RewardFunction,
    combine_rewards,
    env_reward_functions,
    reset_rollout_state,
    reward_metrics,
    set_rollout_state,
)
from environments.framework.evaluation import summarize
from environments.framework.tools import Tool
from environments.inference.backends import sampling_seeds
from environments.inference.tool_parsers import get_parser
from environments.rollout import Rollout
from environments.settings import load_settings, run_token
from environments.trajectory import (
    ScoredGroup,
    ScoredTrajectory,
    TrajectoryFlags,
    equal_scores,
)

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 16
"""Rollouts in flight at once for an env with neither ``concurrency`` nor
``max_queued_groups`` set (``lachesis env process``)."""


class EnvConfig(BaseModel):
    """Settings of an environment. Layering: CLI flags > YAML file > class defaults."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    # episodes
    group_size: int = Field(default=8, ge=1)
    """Rollouts per item; they are sampled concurrently and form one group."""
    max_turns: int = Field(default=4, ge=1)
    """Assistant turns per episode at most."""
    max_token_length: int = Field(default=2048, ge=8)
    """Tokens per context (prompt included) at most: the whole trajectory, or each of its
    segments (``reasoning_history: rerender``); reaching it flags truncation."""
    max_tokens_per_turn: int | None = Field(default=None, ge=1)
    reasoning_history: Literal["keep", "rerender"] = "keep"
    """When the chat template re-renders earlier turns differently (Qwen3's drops their
    ``<think>`` reasoning once more messages follow): ``keep``, the context stays exactly
    what the model sampled and the new messages are appended after it (one context; the
    model keeps seeing its own reasoning); ``rerender``, the conversation is rendered
    anew as the template gives it and a new segment starts there (later turns see the
    history without its reasoning, as at inference; each segment trains as its own row).
    Either way the trained tokens are the sampled ones (docs/environments.md)."""
    # sampling
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    sampling_extra: dict[str, Any] = Field(default_factory=dict)
    """Extra sampling parameters sent as is (e.g. ``min_tokens``, ``top_k``)."""
    concurrency: int | None = Field(default=None, ge=1)
    """Rollouts in flight at once, across groups. None (the default): every rollout of
    every group the env may have under way, ``group_size * max_queued_groups`` (under
    ``lachesis run``: a whole batch, so the inference server batches them all instead of
    a few at a time); without ``max_queued_groups``, ``DEFAULT_CONCURRENCY``."""
    share_identical_requests: bool = True
    """Identical requests made at the same moment (a group's first turns: one prompt) go
    to vLLM as one request with ``n`` (docs/environments.md); they come back together,
    when the longest is done. Off: one request each, each back when it is done (first
    turns with a long tail, where the others should go on without waiting)."""
    # rollout API
    env_name: str | None = Field(default=None, min_length=1, max_length=200)
    """The name the env registers under and writes into its groups (default: the env
    class's ``name``). ``lachesis run`` sets it for an env whose URL holds the port of a
    server it starts, so the name stays the same across ``--resume``."""
    api_url: str = "http://127.0.0.1:8000"
    api_token: str | None = Field(default_factory=run_token)
    """The run's token (env: LACHESIS_API_TOKEN), sent to the rollout API and to the
    inference servers (``inference: vllm``)."""
    api_timeout_s: float = Field(default=30.0, gt=0)
    """How long one request to the rollout API (a push, a status poll beyond its own
    long-poll wait) may take before it counts as unanswered and is retried; after the
    client's retries (about a minute) the group is spooled (``spool_path``)."""
    env_weight: float = Field(default=1.0, gt=0)
    min_batch_allocation: float | None = Field(default=None, ge=0, le=1)
    max_queued_groups: int | None = Field(default=None, ge=1)
    """Wait before starting a group while the rollout API holds this many of this env's
    groups (queued, plus its groups under way): keeps rollouts close to the current
    policy, and one env from crowding out the others. None: never wait."""
    spool_path: Path | None = None
    """Where groups wait while the API is unreachable (default runs/spool/NAME.jsonl)."""
    state_path: Path | None = None
    """``serve``: where the server keeps its place in the item order, so a restarted
    server continues it and samples the items it had in flight again (None: a restart
    starts the item order over)."""
    # inference
    inference: Literal["vllm", "openai"] = "vllm"
    """``vllm``: token-in/token-out, trainable. ``openai``: any chat API, not trainable."""
    inference_servers: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:9000"])
    model: str | None = None
    """Served model name (vLLM: asked from ``/v1/models`` when unset)."""
    tokenizer: str | None = None
    """HF tokenizer (path or name) whose chat template renders prompts; required."""
    openai_base_url: str | None = None
    openai_api_key: str | None = Field(default_factory=lambda: os.environ.get("OPENAI_API_KEY"))
    request_timeout_s: float = Field(default=300.0, gt=0)
    """How long one generation request (a turn: up to ``max_tokens_per_turn`` tokens, with
    the server's queue ahead of it) may take before it fails and is retried on another
    server; health checks of the inference servers wait 5 s."""
    inference_outage_wait_s: float = Field(default=600.0, ge=0)
    """When no inference server is healthy (a vLLM being restarted), requests wait this
    long for one to come back before they fail (and fail their groups)."""
    tool_parser: str = "hermes"
    # output and run length
    jsonl_out: Path | None = None
    """``serve`` also appends every sent group here; ``process`` writes here."""
    total_groups: int | None = Field(default=None, ge=1)
    """Stop after this many groups are delivered (None: run until stopped)."""
    keep_equal_score_groups: bool = False
    """Groups whose trajectories all score the same carry no GRPO signal: dropped (and
    counted) unless this is set."""
    seed: int = 0
    seeded_sampling: bool = False
    """Send every sampling request with a seed drawn from ``seed``, the item, how many times
    it was drawn before, the rollout's place in its group and the turn: the same policy
    then samples the same tokens for it on any run (docs/determinism.md)."""
    groups_per_policy_version: int | None = Field(default=None, ge=1)
    """Lockstep: take items in order until this many groups are delivered, send them in
    item order, then (``serve``) wait for the next policy version before the next ones.
    With this many groups per trainer sync and ``seeded_sampling``, what the trainer gets
    does not depend on timing. None: groups flow as fast as ``concurrency`` and
    ``max_queued_groups`` let them."""
    max_failed_groups_in_a_row: int = Field(default=20, ge=1)
    """Stop with an error when this many groups in a row fail (a broken setup, e.g. a
    prompt longer than max_token_length, would otherwise retry forever)."""
    # evaluation
    eval_items: int = Field(default=32, ge=1)
    eval_temperature: float = Field(default=0.0, ge=0)
    eval_samples: int = Field(default=1, ge=1)
    """Rollouts of every eval item: ``evaluate()`` reports the mean over items of each
    item's mean over its samples, with 95 % intervals over the item means (the samples of
    one item are not independent); more samples narrow the evaluation's own noise."""
    eval_out: Path | None = None

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> EnvConfig:
        """Class defaults < YAML file (top level or under ``env:``) < ``overrides``."""
        return load_settings(cls, path, "env", overrides)

    def rollout_slots(self) -> int:
        """Rollouts in flight at most (``concurrency``, or what its default means)."""
        if self.concurrency is not None:
            return self.concurrency
        if self.max_queued_groups is not None:
            return self.group_size * self.max_queued_groups
        return DEFAULT_CONCURRENCY

    def sampling(self, *, evaluation: bool = False) -> dict[str, Any]:
        temperature = self.eval_temperature if evaluation else self.temperature
        return {"temperature": temperature, "top_p": self.top_p, **self.sampling_extra}


class RewardError(ValueError):
    """An env's reward hook (or reward function) raised or returned something unusable."""


RECENT_FAILURES = 10
"""How many dropped groups ``EnvStats.recent_failures`` keeps."""


@dataclass
class EnvStats:
    groups_sent: int = 0
    groups_dropped_equal_scores: int = 0
    """Groups with no score signal (``trajectory.equal_scores``: every trajectory scored
    the same, turn by turn) dropped, as ``keep_equal_score_groups: false`` asks."""
    groups_kept_equal_scores: int = 0
    """The same kind of groups, kept (``keep_equal_score_groups: true``); ``inspect
    --stats`` counts them with the same function."""
    groups_failed: int = 0
    """Groups dropped because a rollout raised, or could not be turned into a valid
    trajectory (each logged with its item id; the run goes on)."""
    reward_errors: int = 0
    """Groups dropped because a reward hook or reward function raised or returned a bad
    value."""
    reward_function_errors: dict[str, int] = field(default_factory=dict)
    """Rollouts failed by each reward function (by name) that raised or returned a bad
    value."""
    trajectories: int = 0
    truncated: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    assistant_turns: int = 0
    sampled_tokens: int = 0
    not_prefix_preserving: int = 0
    generation_seconds: float = 0.0
    """Summed over the rollouts of the groups collected: waiting for the inference
    server's turns..."""
    env_seconds: float = 0.0
    """... the env's own work (tools, sandboxes, rewards) ..."""
    queue_wait_seconds: float = 0.0
    """... waiting for a rollout slot (``concurrency``)."""
    backpressure_seconds: float = 0.0
    """Time the env server held back new groups because the rollout API held
    ``max_queued_groups`` already (the trainer is behind)."""
    recent_failures: list[dict[str, str]] = field(default_factory=list)
    """The last ``RECENT_FAILURES`` dropped groups (failed or reward errors): item id and
    the first error."""


def _check_reward_value(value: Any, per_turn: bool, n_turns: int
                        ) -> tuple[float | list[float] | None, str | None]:
    """``(value as float(s), None)`` or ``(None, what is wrong)``."""
    def number(x: Any) -> float | None:
        # bool, int, float and numpy scalars; not strings, None or containers
        if isinstance(x, (bool, int, float, np.bool_, np.integer, np.floating)) \
                and math.isfinite(float(x)):
            return float(x)
        return None

    if per_turn:
        if isinstance(value, np.ndarray) and value.ndim == 1:
            value = value.tolist()
        if not isinstance(value, (list, tuple)) or len(value) != n_turns:
            got = f"{len(value)} values" if isinstance(value, (list, tuple)) else repr(value)
            return None, f"returned {got} for {n_turns} assistant turns (per_turn: one each)"
        floats = [number(x) for x in value]
        if any(x is None for x in floats):
            return None, f"returned a non-finite or non-numeric value in {list(value)!r}"
        return floats, None
    converted = number(value)
    if converted is None:
        return None, f"returned {value!r}, not a finite number"
    return converted, None


class TurnLevelRewardMixin:
    """Per-assistant-turn rewards: implement ``compute_turn_rewards(item, rollout)``.

    It returns one float per assistant turn of ``rollout`` (``len(rollout.turns)``), in
    order; the last one is the episode's outcome. The trajectory then carries ``scores``
    as that list and one ``turn_spans`` entry per turn.
    """

    def compute_turn_rewards(self, item: Any, rollout: Rollout) -> list[float]:
        raise NotImplementedError(f"{type(self).__name__} must implement compute_turn_rewards")


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class BaseEnv:
    """Base class of environments. See the module docstring for the hooks."""

    name: ClassVar[str] = "env"
    config_class: ClassVar[type[EnvConfig]] = EnvConfig
    tools: ClassVar[list[Tool]] = []
    reward_functions: ClassVar[list[RewardFunction]] = []
    """Reward functions ``(item, rollout, state)`` (see :mod:`environments.framework.rewards`), in
    addition to ``@reward_function`` methods. With any, they replace ``compute_reward`` /
    ``compute_turn_rewards``."""

    def __init__(self, config: EnvConfig | None = None):
        self.config = config or self.config_class()
        if self.config.env_name is not None:
            self.name = self.config.env_name
        self.stats = EnvStats()
        self.rng = random.Random(self.config.seed)
        self.policy_version: int | None = None
        self.queued_groups: int | None = None
        """Groups waiting in the rollout API (``serve`` keeps it current)."""
        self.renderer = None
        self.backend = None
        self.eval_backend = None
        self.parser = get_parser(self.config.tool_parser)
        self._pool = None
        self._failed_in_a_row = 0
        self.last_error: str | None = None
        self._rollout_slots = asyncio.Semaphore(self.config.rollout_slots())
        self._draws: collections.Counter[tuple[str, str]] = collections.Counter()
        self._reward_functions = env_reward_functions(self)
        if self._reward_functions:
            cls = type(self)
            overridden = [hook for hook, base in (
                ("compute_reward", BaseEnv.compute_reward),
                ("compute_turn_rewards", TurnLevelRewardMixin.compute_turn_rewards))
                if getattr(cls, hook, base) is not base]
            if overridden:
                raise TypeError(f"{cls.__name__} declares reward functions and overrides "
                                f"{overridden[0]}: use one or the other")

    # -- hooks ---------------------------------------------------------------------------
    async def setup(self) -> None:
        """Load data, build tools. Called once before the first item."""

    async def get_next_item(self) -> Any:
        """The next training item (any object; a dict with an ``id`` key is handy)."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_next_item")

    def item_id(self, item: Any) -> str:
        if isinstance(item, dict) and "id" in item:
            return str(item["id"])
        return str(getattr(item, "id", id(item)))

    def prompt_messages(self, item: Any) -> list[dict[str, Any]]:
        """The messages an episode starts from (used by the default collect_trajectory)."""
        raise NotImplementedError(f"{type(self).__name__} must implement prompt_messages")

    def get_tools(self, item: Any) -> list[Tool]:
        return list(self.tools)

    async def collect_trajectory(self, item: Any, *, evaluation: bool = False) -> Rollout:
        """One rollout of ``item``. Default: the multi-turn agent loop with this env's tools."""
        return await run_agent_loop(
            self.eval_backend if evaluation else self.backend, self.renderer,
            self.prompt_messages(item), tools=self.get_tools(item), parser=self.parser,
            max_turns=self.config.max_turns, max_token_length=self.config.max_token_length,
            max_tokens_per_turn=self.config.max_tokens_per_turn,
            policy_version=lambda: self.policy_version,
            reasoning_history=self.config.reasoning_history)

    def scores_each_turn(self) -> bool:
        """Whether ``compute_turn_rewards`` (one score per assistant turn) scores this env's
        rollouts rather than ``compute_reward``. Default: the class mixes in
        :class:`TurnLevelRewardMixin`; an env whose settings choose overrides it."""
        return isinstance(self, TurnLevelRewardMixin)

    def compute_reward(self, item: Any, rollout: Rollout) -> float:
        """The episode's score (may be ``async``). Not needed with TurnLevelRewardMixin or
        reward functions. ``rollout.env_state`` is the snapshot of the per-rollout state."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_reward "
                                  "(or declare reward functions)")

    def new_rollout_state(self, item: Any) -> Any:
        """The per-rollout state of a new rollout of ``item`` (may be ``async``): any
        object, shared by that rollout's tools (:func:`environments.framework.rewards.rollout_state`,
        or ``@tool(state_arg=...)``). Default: ``None`` (no state)."""
        return None

    def snapshot_state(self, state: Any) -> Any:
        """What the reward hooks see of ``state`` when the rollout has finished; taken at
        once, before any other rollout can run. Default: ``copy.deepcopy``. Override when
        the state cannot be deep-copied (a sandbox handle: read out what is scored) or
        is big; it must not return an object that a later rollout will change."""
        return copy.deepcopy(state)

    async def eval_items(self) -> list[Any]:
        """Items for ``evaluate()``. Default: the next ``eval_items`` training items."""
        return [await self.get_next_item() for _ in range(self.config.eval_items)]

    async def evaluate(self) -> dict[str, Any]:
        """``eval_samples`` rollouts of every eval item (eval temperature); each metric the
        mean over items of the item's mean, its interval over the item means
        (:func:`environments.framework.evaluation.summarize`)."""
        items = await self.eval_items()
        k = self.config.eval_samples
        runs = [(item, key) for item in items for key in self._seed_keys(item, k, "eval")]
        results = await asyncio.gather(*(self._eval_one(item, key) for item, key in runs),
                                       return_exceptions=True)
        for (item, _), r in zip(runs, results):
            if isinstance(r, BaseException):
                log.error("evaluation of item %s failed: %s: %s", self.item_id(item),
                          type(r).__name__, r)
        finished = [[r for r in results[i * k:(i + 1) * k] if not isinstance(r, BaseException)]
                    for i in range(len(items))]
        failed = sum(isinstance(r, BaseException) for r in results)
        metrics = {"env": self.name, **summarize(finished, failed)}
        if self.config.eval_out is not None:
            from environments.jsonl_store import GroupWriter
            with GroupWriter(self.config.eval_out) as writer:
                for item, samples in zip(items, finished):
                    if samples:  # one group per item: its finished samples
                        writer.append(ScoredGroup(
                            env=self.name, item_id=self.item_id(item),
                            trajectories=[t for _, t in samples],
                            metadata={"evaluation": True}))
        return metrics

    async def _eval_one(self, item: Any, seed_key: str | None = None
                        ) -> tuple[Rollout, ScoredTrajectory]:
        rollout, scores = await self._rollout(item, evaluation=True, seed_key=seed_key)
        return rollout, self.to_trajectory(item, rollout, scores)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to inference (with vLLM: refuse token limits its servers cannot serve,
        :mod:`environments.framework.limits`), then call ``setup()``. If any of it fails,
        the env is closed again before the error is raised."""
        from environments.inference.chat_template import ChatRenderer
        from environments.inference.tokenizer import load_tokenizer

        config = self.config
        if config.tokenizer is None and config.model is None:
            raise ValueError("set `tokenizer` (a HF tokenizer path or name) to render prompts")
        tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.renderer = ChatRenderer(tokenizer)
        try:
            await self._connect()
            await self.setup()
        except BaseException:
            try:  # nothing left open (no "Unclosed client session" at exit)
                await self.close()
            except Exception:  # noqa: BLE001 - the start's own error is the one to see
                log.debug("closing the env after its failed start failed too", exc_info=True)
            raise

    async def _connect(self) -> None:
        """The inference backends; with vLLM, the env's token limits checked against
        every server's ``max_model_len`` (:mod:`environments.framework.limits`)."""
        from environments.inference.backends import OpenAIBackend, VLLMBackend
        from environments.inference.vllm_client import VLLMServerPool

        config = self.config
        if config.inference == "vllm":
            self._pool = VLLMServerPool(config.inference_servers, config.model,
                                        api_key=config.api_token,
                                        timeout_s=config.request_timeout_s,
                                        outage_wait_s=config.inference_outage_wait_s,
                                        share_identical=config.share_identical_requests)
            await self._pool.start()
            check_context_limits(config.max_token_length, config.max_tokens_per_turn,
                                 self._pool.context_limits, self._pool.model)
            self.backend = VLLMBackend(self._pool, self.renderer, config.sampling())
            self.eval_backend = VLLMBackend(self._pool, self.renderer,
                                            config.sampling(evaluation=True))
        else:
            import openai

            if config.model is None:
                raise ValueError("inference: openai needs `model`")
            client = openai.AsyncOpenAI(base_url=config.openai_base_url,
                                        api_key=config.openai_api_key or "none",
                                        timeout=config.request_timeout_s)
            sampling = {k: v for k, v in config.sampling().items()
                        if k in ("temperature", "top_p")}
            eval_sampling = {k: v for k, v in config.sampling(evaluation=True).items()
                             if k in ("temperature", "top_p")}
            self.backend = OpenAIBackend(client, config.model, self.renderer, sampling)
            self.eval_backend = OpenAIBackend(client, config.model, self.renderer, eval_sampling)

    def use_policy_model(self, name: str) -> None:
        """Send the next vLLM requests to model ``name``: the trainer's newest policy when
        it is served under its own name (a LoRA adapter version; see ``/status``)."""
        if self._pool is not None and self._pool.model != name:
            log.info("requests go to model %s from now on", name)
            self._pool.model = name

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    # -- scoring -------------------------------------------------------------------------
    async def _score(self, item: Any, rollout: Rollout) -> float | list[float]:
        if self._reward_functions:
            return await self._score_with_functions(item, rollout)
        if self.scores_each_turn():
            scores = await _maybe_await(self.compute_turn_rewards(item, rollout))
            if not isinstance(scores, (list, tuple)) or len(scores) != len(rollout.turns):
                got = f"{len(scores)} scores" if isinstance(scores, (list, tuple)) else repr(scores)
                raise RewardError(f"item {self.item_id(item)}: compute_turn_rewards returned "
                                  f"{got} for {len(rollout.turns)} assistant turns")
            scores = [float(s) for s in scores]
        else:
            scores = float(await _maybe_await(self.compute_reward(item, rollout)))
        values = scores if isinstance(scores, list) else [scores]
        if not all(math.isfinite(v) for v in values):
            raise RewardError(f"item {self.item_id(item)}: non-finite reward {scores}")
        return scores

    async def _score_with_functions(self, item: Any,
                                    rollout: Rollout) -> float | list[float]:
        """Call every reward function on ``(item, rollout, rollout.env_state)``
        (concurrently), check the values, keep them in ``rollout.reward_values`` and
        combine them (:func:`environments.framework.rewards.combine_rewards`)."""
        functions = self._reward_functions
        n_turns = len(rollout.turns)

        async def call(function: RewardFunction) -> Any:
            return await _maybe_await(function.fn(item, rollout, rollout.env_state))

        results = await asyncio.gather(*(call(f) for f in functions), return_exceptions=True)
        values: dict[str, float | list[float]] = {}
        problems: list[tuple[str, str, BaseException | None]] = []
        for function, result in zip(functions, results):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                problems.append((function.name, f"raised {type(result).__name__}: {result}",
                                 result))
                continue
            value, problem = _check_reward_value(result, function.per_turn, n_turns)
            if problem is not None:
                problems.append((function.name, problem, None))
            else:
                values[function.name] = value
        if problems:
            for name, _, _ in problems:
                errors = self.stats.reward_function_errors
                errors[name] = errors.get(name, 0) + 1
            name, problem, cause = problems[0]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise RewardError(f"item {self.item_id(item)}: reward function {name!r} "
                              f"{problem}{more}") from cause
        rollout.reward_values = values
        per_turn_scores = isinstance(self, TurnLevelRewardMixin) or any(
            f.per_turn for f in functions)
        if per_turn_scores and n_turns == 0:
            raise RewardError(f"item {self.item_id(item)}: per-turn scores need at least "
                              "one assistant turn; the rollout has none")
        scores = combine_rewards(values, functions, n_turns, per_turn_scores=per_turn_scores)
        combined = scores if isinstance(scores, list) else [scores]
        if not all(math.isfinite(v) for v in combined):
            raise RewardError(f"item {self.item_id(item)}: non-finite combined reward "
                              f"{scores} from {values}")
        return scores

    def rollout_metrics(self, item: Any, rollout: Rollout,
                        scores: float | list[float]) -> dict[str, float]:
        """Numbers that describe one rollout (e.g. ``tool_success``, ``correct``): stored in
        the trajectory's ``metadata["metrics"]``, averaged by ``evaluate`` and, per batch, by
        the trainer. Override to report an env's own measures."""
        return {}

    def turn_anchors(self, item: Any, rollout: Rollout) -> list[str] | None:
        """One key per assistant turn naming the state the turn starts from; turns of a
        group with the same key are compared by GiGPO (``estimator: gigpo``). Default: a
        hash of the observation before each turn (the tool results or user message since
        the previous assistant turn; the prompt for the first), from ``rollout.messages``
        (:func:`~environments.framework.agent_loop.observation_anchors`). Override when the
        env knows its state better (e.g. a board position); return ``None`` for none."""
        return observation_anchors(rollout.messages, len(rollout.turns))

    def to_trajectory(self, item: Any, rollout: Rollout,
                      scores: float | list[float]) -> ScoredTrajectory:
        versions = [t.policy_version for t in rollout.turns]
        known = all(v is not None for v in versions) and versions
        return ScoredTrajectory(
            tokens=rollout.tokens, masks=rollout.masks, scores=scores,
            inference_logprobs=rollout.logprobs if rollout.trainable else None,
            turn_spans=[list(t.span) for t in rollout.turns],
            segment_starts=rollout.segment_starts or None,
            turn_anchors=self.turn_anchors(item, rollout) if rollout.turns else None,
            messages=rollout.messages,
            policy_version=min(versions) if known else None,
            turn_policy_versions=versions if known else None,
            flags=TrajectoryFlags(truncated=rollout.truncated, tool_errors=rollout.tool_errors,
                                  trainable=rollout.trainable),
            metadata={"item_id": self.item_id(item), "stop": rollout.stop,
                      "prefix_preserving": rollout.prefix_preserving,
                      "turns": describe_turns(rollout),
                      **({"segments": rollout.extra["segments"]}
                         if rollout.segment_starts else {}),
                      **({"rewards": dict(rollout.reward_values)}
                         if rollout.reward_values else {}),
                      "seconds": {"generation": round(rollout.generation_seconds, 4),
                                  "env": round(rollout.env_seconds, 4),
                                  "queue_wait": round(rollout.queue_wait_seconds, 4)},
                      "metrics": {**reward_metrics(rollout.reward_values),
                                  **self.rollout_metrics(item, rollout, scores)}})

    def _seed_keys(self, item: Any, n: int, kind: str) -> list[str | None]:
        """The sampling-seed keys of ``n`` rollouts of ``item`` (``seeded_sampling``; else
        None): seed, kind, item id, how many times the item was drawn, rollout index."""
        if not self.config.seeded_sampling:
            return [None] * n
        item_id = self.item_id(item)
        draw = self._draws[kind, item_id]
        self._draws[kind, item_id] += 1
        return [f"{self.config.seed}/{kind}/{item_id}/{draw}/{i}" for i in range(n)]

    async def _rollout(self, item: Any, *, evaluation: bool = False,
                       seed_key: str | None = None) -> tuple[Rollout, float | list[float]]:
        """One rollout within the concurrency limit, scored (its requests seeded from
        ``seed_key``'s stream when one is given).

        The per-rollout state (``new_rollout_state``) is the current rollout state of this
        task while ``collect_trajectory`` runs; its snapshot is taken as soon as it
        returns, with no ``await`` in between, so no other rollout can change the state
        before it is copied. Scoring then reads only the snapshot."""
        asked = time.monotonic()
        async with self._rollout_slots:
            began = time.monotonic()
            state = await _maybe_await(self.new_rollout_state(item))
            token = set_rollout_state(state)
            try:  # (user overrides may take no `evaluation`)
                with sampling_seeds(seed_key):
                    rollout = await (self.collect_trajectory(item, evaluation=True)
                                     if evaluation else self.collect_trajectory(item))
                try:
                    snapshot = self.snapshot_state(state)
                except Exception as error:
                    raise RuntimeError(
                        f"item {self.item_id(item)}: snapshot_state failed ({type(error).__name__}: "
                        f"{error}); override snapshot_state to copy what the rewards "
                        "read") from error
                if inspect.isawaitable(snapshot):
                    if inspect.iscoroutine(snapshot):
                        snapshot.close()
                    raise TypeError("snapshot_state must be synchronous: an await would let "
                                    "other rollouts change the state before it is copied")
                rollout.env_state = snapshot
            finally:
                reset_rollout_state(token)
        scores = await self._score(item, rollout)
        rollout.queue_wait_seconds = began - asked
        rollout.env_seconds = time.monotonic() - began - rollout.generation_seconds
        return rollout, scores

    async def collect_group(self, item: Any) -> ScoredGroup | None:
        """Sample ``group_size`` rollouts of ``item`` concurrently and score them.

        Returns None (and counts why) when the group must not be sent.
        """
        item_id = self.item_id(item)
        keys = self._seed_keys(item, self.config.group_size, "train")
        results = await asyncio.gather(*(self._rollout(item, seed_key=key) for key in keys),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.group_failed(item_id, errors[0], f"{len(errors)} of {len(results)} "
                              "rollouts failed", reward=any(isinstance(e, RewardError)
                                                            for e in errors))
            if not isinstance(errors[0], Exception):
                raise errors[0]
            return None
        try:
            trajectories = [self.to_trajectory(item, rollout, scores)
                            for rollout, scores in results]
            group = ScoredGroup(
                group_id=uuid.uuid4().hex, env=self.name, item_id=item_id,
                trajectories=trajectories,
                generation_params={"max_turns": self.config.max_turns,
                                   "max_token_length": self.config.max_token_length,
                                   **self.config.sampling()})
        except Exception as error:  # e.g. a message that breaks the data contract
            self.group_failed(item_id, error, "a rollout is not a valid trajectory",
                              traceback=True)
            return None
        self._failed_in_a_row = 0
        for rollout, _ in results:
            s = self.stats
            s.trajectories += 1
            s.truncated += rollout.truncated
            s.tool_calls += rollout.tool_calls
            s.tool_errors += rollout.tool_errors
            s.assistant_turns += len(rollout.turns)
            s.sampled_tokens += sum(e - b for b, e in (t.span for t in rollout.turns))
            s.not_prefix_preserving += not rollout.prefix_preserving
            s.generation_seconds += rollout.generation_seconds
            s.env_seconds += rollout.env_seconds
            s.queue_wait_seconds += rollout.queue_wait_seconds
        if equal_scores(trajectories):
            if not self.config.keep_equal_score_groups:
                self.stats.groups_dropped_equal_scores += 1
                return None
            self.stats.groups_kept_equal_scores += 1
        return group

    def group_failed(self, item_id: str | None, error: BaseException, why: str, *,
                     reward: bool = False, traceback: bool = False) -> None:
        """Count and log a group that is dropped because of ``error`` (never scored):
        ``reward_errors`` when a reward hook is to blame, else ``groups_failed``."""
        if reward:
            self.stats.reward_errors += 1
        else:
            self.stats.groups_failed += 1
        self._failed_in_a_row += 1
        self.last_error = f"{type(error).__name__}: {error}"
        self.stats.recent_failures = [*self.stats.recent_failures[1 - RECENT_FAILURES:],
                                      {"item_id": str(item_id), "error": self.last_error[:500]}]
        log.error("group for item %s dropped: %s; first: %s", item_id, why, self.last_error,
                  exc_info=error if traceback else None)

    def _item_id_or_none(self, item: Any) -> str | None:
        try:
            return None if item is None else self.item_id(item)
        except Exception:  # noqa: BLE001 - only for the log line of a failure
            return None

    # -- running (environments.framework.runner) ------------------------------------------
    async def run_groups(self, delivery: Any, n_groups: int | None) -> None:
        """Collect groups and hand each to ``delivery.send`` (see :func:`runner.run_groups`)."""
        await runner.run_groups(self, delivery, n_groups)

    def describe_stats(self) -> dict[str, Any]:
        return asdict(self.stats)

    async def process(self, out: str | Path, n_groups: int) -> dict[str, Any]:
        """Offline: write ``n_groups`` groups to the JSONL file ``out``."""
        return await runner.process(self, out, n_groups)

    async def serve(self) -> dict[str, Any]:
        """Push groups to the rollout API until ``total_groups`` (or forever)."""
        return await runner.serve(self)
