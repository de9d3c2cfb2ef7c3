"""Demonstrators of Gymnasium-style envs, for SFT warm starts (``warm_start`` of ``lachesis
run``, ``make-tiny-model --tokenizer env``): a scripted policy played through the env, one
step per turn, in the messages the model would see and the action text it would type.

* **The policy.** ``demonstrator: PACKAGE.MODULE:FUNC`` names ``FUNC(observation, info,
  history) -> action`` (``observation``: the latest observation as the model reads it;
  ``info``: the env's info of that step; ``history``: the conversation so far, chat
  messages, the last one that observation), returning the action text, or None for none
  (the noise's action is then taken). An env class may instead override
  :meth:`NoisyDemonstrator.policy_action` (``textworld_cooking``: the game's planner).
* **ε-noise.** Each step, with probability ε the action is the noise's (so the
  demonstrations show recoveries): ``demonstrator_noise: PACKAGE.MODULE:FUNC``,
  ``FUNC(observation, info, history, pick) -> action`` with ``pick`` uniform in [0, 1)
  (default: the ``pick``-th share of the env's admissible actions). Every step draws the
  same two numbers whatever ε (whether it is noisy, and ``pick``), so a game's
  demonstrations at two ε differ only in which steps are noisy.
* **Calibration.** ``target_success: [lo, hi]``: at start, ε is bisected on the first
  ``calibration_games`` held-out items until the demonstrator wins a share inside the band
  (more noise, fewer wins); an error says so, with what was measured, when none can.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import random
import re
from collections.abc import Callable
from typing import Any

from pydantic import Field, model_validator

from environments.framework.base import EnvConfig

log = logging.getLogger(__name__)

_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def load_function(target: str, setting: str) -> Callable[..., Any]:
    """The callable ``PACKAGE.MODULE:FUNC`` names; ValueError naming ``setting`` if none."""
    if not _TARGET.fullmatch(target):
        raise ValueError(f"{setting}: {target!r} is not PACKAGE.MODULE:FUNC")
    module_name, _, name = target.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{setting}: cannot load {name!r} from {module_name!r} "
                         f"({type(error).__name__}: {error})") from None
    if not callable(function):
        raise ValueError(f"{setting}: {target} is not callable")
    return function


class DemonstratorConfig(EnvConfig):
    """The demonstrator's settings (:class:`NoisyDemonstrator`)."""

    demonstrator: str | None = None
    """``PACKAGE.MODULE:FUNC``: the demonstrator's policy, ``FUNC(observation, info,
    history) -> action text`` (None: no action, the noise's is taken). None: no
    demonstrator (unless the env has its own, as ``textworld_cooking``)."""
    demonstrator_noise: str | None = None
    """``PACKAGE.MODULE:FUNC``: a noisy step's action, ``FUNC(observation, info, history,
    pick)``, ``pick`` uniform in [0, 1). None: one of the env's admissible actions."""
    demonstrator_epsilon: float | None = Field(default=None, ge=0, le=1)
    """The share of noisy steps. None: calibrated to ``target_success`` when that is set,
    else 0."""
    target_success: tuple[float, float] | None = None
    """``[lo, hi]``: at start, find an ε whose demonstrations win a share of the
    ``calibration_games`` held-out items within it (bisection; an error says so when none
    can)."""
    calibration_games: int = Field(default=64, ge=1)
    """Held-out items the calibration plays (the first of the eval items)."""

    @model_validator(mode="after")
    def _demonstrator_settings(self) -> DemonstratorConfig:
        if self.target_success is not None:
            lo, hi = self.target_success
            if not 0 <= lo <= hi <= 1:
                raise ValueError(f"target_success {list(self.target_success)}: need "
                                 "0 <= lo <= hi <= 1")
            if self.demonstrator_epsilon is not None:
                raise ValueError("set demonstrator_epsilon or target_success, not both")
        for setting in ("demonstrator", "demonstrator_noise"):
            if getattr(self, setting) is not None:
                load_function(getattr(self, setting), setting)
        return self


class NoisyDemonstrator:
    """The ε-noisy demonstrator of a :class:`~environments.adapters.gym_env.GymEnv`
    (``oracle_messages``). Uses the env's ``config``, ``make_episode``, ``first_messages``,
    ``eval_items`` and ``succeeded``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.epsilon = self.config.demonstrator_epsilon or 0.0
        self.calibration: list[dict[str, float]] = []
        """The calibration's tries: ``{"epsilon", "success"}`` each."""
        self.calibration_items: list[Any] = []
        """The held-out items the calibration plays (set at start)."""
        self._demonstrations: dict[str, int] = {}
        self._policy = self._noise = None

    @classmethod
    def demonstrator_problem(cls, config: DemonstratorConfig) -> str | None:
        """Why this env with ``config`` cannot demonstrate (None: it can)."""
        if cls.policy_action is NoisyDemonstrator.policy_action and config.demonstrator is None:
            return ("it has no demonstrator: set demonstrator: PACKAGE.MODULE:FUNC (a policy "
                    "(observation, info, history) -> action text)")
        if getattr(config, "action_mode", "text") != "text":
            return "demonstrators play text actions: set action_mode: text"
        return None

    # -- what a step plays (override for an env's own demonstrator) -----------------------
    def policy_action(self, observation: str, info: dict[str, Any],
                      history: list[dict[str, Any]]) -> str | None:
        """The demonstrator's action (default: the ``demonstrator`` function's)."""
        if self._policy is None:
            problem = self.demonstrator_problem(self.config)
            if problem:
                raise ValueError(f"{self.name}: {problem}")
            self._policy = load_function(self.config.demonstrator, "demonstrator")
        return self._policy(observation, info, history)

    def noise_action(self, observation: str, info: dict[str, Any],
                     history: list[dict[str, Any]], pick: float) -> str | None:
        """A noisy step's action: the ``demonstrator_noise`` function's, or the
        ``pick``-th share of the admissible actions (None when the env lists none)."""
        if self.config.demonstrator_noise is not None:
            if self._noise is None:
                self._noise = load_function(self.config.demonstrator_noise,
                                            "demonstrator_noise")
            return self._noise(observation, info, history, pick)
        key = getattr(self.config, "admissible_key", None)
        admissible = info.get(key) if key else None
        if isinstance(admissible, (list, tuple)) and admissible:
            return str(admissible[int(pick * len(admissible))])
        return None

    def demonstration_episode(self, item: dict[str, Any]) -> Any:
        """The episode a demonstration plays (default: the one the model plays)."""
        return self.make_episode(item)

    # -- playing and calibrating ------------------------------------------------------------
    def demonstrate(self, item: dict[str, Any], epsilon: float,
                    rng: random.Random) -> tuple[list[dict[str, Any]], bool]:
        """One episode of the ε-noisy demonstrator, as the policy would see and play it:
        the messages, and whether it succeeded. At most ``max_turns`` steps."""
        episode = self.demonstration_episode(item)
        try:
            messages = self.first_messages(item, episode.reset())
            for _ in range(self.config.max_turns):
                if episode.done:
                    break
                observation, info = messages[-1]["content"], episode.info
                noisy, pick = rng.random() < epsilon, rng.random()
                action = self.noise_action(observation, info, messages, pick) if noisy \
                    else None
                if action is None:
                    action = self.policy_action(observation, info, messages)
                if action is None and not noisy:
                    action = self.noise_action(observation, info, messages, pick)
                if action is None:
                    raise ValueError(f"{self.name}: the demonstrator has no action for "
                                     f"item {item.get('id')} after {len(episode.rewards)} "
                                     "steps (its policy and its noise gave None)")
                parsed, problem = episode.action_from_text(action)
                if problem is not None:
                    raise ValueError(f"{self.name}: the demonstrator's action {action!r} is "
                                     f"not one the env takes: {problem}")
                observation, _ = episode.step(parsed)
                messages += [{"role": "assistant", "content": action},
                             {"role": "user", "content": observation}]
            return messages, self.succeeded(episode)
        finally:
            episode.close()

    def demonstrator_success(self, epsilon: float, items: list[dict[str, Any]]) -> float:
        """The share of ``items`` the ε-noisy demonstrator wins (the same random numbers for
        every ε: item k draws from ``Random(k)``)."""
        wins = [self.demonstrate(item, epsilon, random.Random(k))[1]
                for k, item in enumerate(items)]
        return sum(wins) / len(wins)

    def calibrate(self, lo: float, hi: float, steps: int = 12) -> float:
        """An ε whose demonstrator wins a share in ``[lo, hi]`` of the calibration items
        (bisection: more noise, fewer wins); ValueError, with what was measured, when
        there is none."""
        items = self.calibration_items

        def success(epsilon: float) -> float:
            value = self.demonstrator_success(epsilon, items)
            self.calibration.append({"epsilon": epsilon, "success": value})
            log.info("%s: demonstrator at epsilon %.4f wins %.3f of %d held-out games",
                     self.name, epsilon, value, len(items))
            return value

        low, high = 0.0, 1.0
        at_low, at_high = success(low), success(high)
        if at_low < lo or at_high > hi:
            raise ValueError(
                f"target_success [{lo}, {hi}] cannot be reached on {len(items)} held-out "
                f"games: the demonstrator wins {at_low:.3f} at epsilon 0 and {at_high:.3f} "
                "at epsilon 1")
        for value, epsilon in ((at_low, low), (at_high, high)):
            if lo <= value <= hi:
                return epsilon
        for _ in range(steps):
            middle = (low + high) / 2
            value = success(middle)
            if lo <= value <= hi:
                return middle
            low, high = (middle, high) if value > hi else (low, middle)
        tries = ", ".join(f"{t['epsilon']:.4f}: {t['success']:.3f}" for t in self.calibration)
        raise ValueError(f"target_success [{lo}, {hi}]: no epsilon found in {steps} "
                         f"bisection steps on {len(items)} held-out games (epsilon: "
                         f"success {tries}); widen the band or use more calibration_games")

    async def setup_demonstrator(self) -> None:
        """At start: the calibration items, and ε calibrated when ``target_success`` is
        set."""
        config = self.config
        self.calibration_items = list((await self.eval_items())[:config.calibration_games])
        if config.target_success is not None:
            self.epsilon = await asyncio.to_thread(self.calibrate, *config.target_success)

    def demonstrator_summary(self) -> dict[str, Any]:
        """The demonstrator's ε, and the calibration's tries when ``target_success`` set
        it (``lachesis run`` writes this to ``warm_start/demonstrator.json``)."""
        return {"epsilon": self.epsilon, "target_success": self.config.target_success,
                "calibration_games": len(self.calibration_items)
                if self.config.target_success is not None else 0,
                "calibration": self.calibration}

    def oracle_messages(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """A demonstration of ``item`` by the ε-noisy demonstrator (``demonstrator_epsilon``,
        or the calibrated ε): a new one each time the item is drawn."""
        draw = self._demonstrations.get(item["id"], 0)
        self._demonstrations[item["id"]] = draw + 1
        rng = random.Random(f"{self.config.seed}/{item['seed']}/{draw}")
        return self.demonstrate(item, self.epsilon, rng)[0]
