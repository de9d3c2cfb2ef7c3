"""An OpenEnv server written with openenv-core's own ``Environment`` and ``create_app``:
guess a hidden digit. Run it (in a venv with openenv-core) with
``python -m uvicorn openenv_guess_server:app``; ``GUESS_MAX_SESSIONS`` sets how many
episodes may run at once (openenv's ``max_concurrent_envs``).

Each step rewards the guess: 1.0 when right (and the episode is done), else
``-0.1 * |guess - target|``; the episode is done after the right guess or 3 wrong ones.
"""

import os
import random

from openenv.core.env_server import Environment, create_app
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    """Guess the hidden digit."""

    guess: int = Field(ge=1, le=9, description="the digit you guess, 1 to 9")


class GuessObservation(Observation):
    message: str


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State()
        self._target = 5

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs) -> GuessObservation:
        self._target = random.Random(seed).randint(1, 9)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message="Guess the hidden digit (1 to 9).")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        right = action.guess == self._target
        hint = "right" if right else ("higher" if action.guess < self._target else "lower")
        return GuessObservation(message=hint, reward=1.0 if right else
                                -0.1 * abs(action.guess - self._target),
                                done=right or self._state.step_count >= 3)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnv, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=int(os.environ.get("GUESS_MAX_SESSIONS", "1")))
