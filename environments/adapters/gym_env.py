"""Gymnasium-style environments: ``lachesis env serve gym:SPEC``.

Any object with ``reset(seed=...) -> (observation, info)`` and ``step(action) ->
(observation, reward, terminated, truncated, info)`` (Gymnasium's API, GEM's; the older
4-tuple ``(observation, reward, done, info)`` is read too) is played by the policy, one
step per assistant turn. SPEC names where the env comes from:

=============================  ===========================================================
``gem/ID``                      ``gem.make(ID, **make_kwargs)`` (gem-llm), e.g.
                                ``gym:gem/game:Mastermind-v0-easy``
``gymnasium/ID``                ``gymnasium.make(ID, **make_kwargs)``, e.g.
                                ``gym:gymnasium/Taxi-v3`` (``make_kwargs: {render_mode:
                                ansi}`` gives a text view of non-text observations)
``textworld/PATH``              a TextWorld game file (``.z8``/``.ulx`` with its ``.json``),
                                played through :class:`TextWorldGame`
``package.module:FACTORY``      ``FACTORY(**make_kwargs)``, any callable returning an env
=============================  ===========================================================

An episode (:func:`run_gym_episode`): ``reset(seed)`` with the item's seed; the
observation (as text, with the env's admissible actions when it lists them) is the first
user message after ``system_prompt``; each assistant turn's action goes to ``step``:

* ``action_mode: text``: the reply's text (or the last match of ``action_pattern``'s first
  group); the next observation comes back as a user message;
* ``action_mode: tool``: the arguments of one call of the tool ``tool_name`` (its
  parameters: one string ``action``, or an integer for a ``Discrete`` action space); the
  next observation is the tool's result. A reply without a call ends the episode
  (``stop: answer``), as in the agent loop.

The step's reward is that turn's score (``TurnLevelRewardMixin``; ``reward_scale`` times
it); ``terminated`` or ``truncated`` end the episode (``stop: done``). The last turn's
score is the outcome: its reward (``outcome: last_reward``) or whether the episode
succeeded (``outcome: success``, 1 or 0). Success is an info flag (``success_info_key``,
e.g. TextWorld's ``won``) or, without one, an episode the env terminated (not truncated)
with a positive last reward. An action the env cannot take (no integer for a
``Discrete`` space, a malformed call) is not stepped: it scores ``invalid_action_score``
and the model is told why.

History (``history``): ``full``, the whole conversation is the context (one training row);
``window``, the system prompt, the first observation and the last ``window_turns`` turns:
the first ``window_turns + 1`` turns share the first context, each later one starts a new
segment (the context rendered anew, trained as its own row, ``segment_starts``), so long
episodes fit a small context.

Envs run in the env server's process, on its event loop (their calls are synchronous and
short). Each episode keeps its own state of Python's and NumPy's global random number
generators, swapped in around each of its env calls: GEM seeds ``random`` globally at
``reset`` and Minesweeper places its mines at the first step, so without that a group's
concurrent episodes would draw from each other's streams and the same seed would not give
the same game. At start the env is made and reset once with the network blocked: an env
that needs a download at run time (GEM's Wordle fetches NLTK's word list) fails there,
with a message naming what it tried to reach.

Warm starts: ``demonstrator`` names a scripted policy whose ε-noisy episodes are the env's
``oracle_messages`` (:mod:`environments.adapters.gym_demonstrator`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import random
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, create_model

from environments.adapters.gym_demonstrator import (
    DemonstratorConfig,
    NoisyDemonstrator,
    load_function,
)
from environments.adapters.textworld_game import TextWorldGame
from environments.framework.base import BaseEnv, TurnLevelRewardMixin
from environments.framework.tools import ToolError, validate_arguments
from environments.inference.chat_template import ChatRenderer
from environments.inference.tool_parsers import ToolCallParser, to_message_tool_calls
from environments.inference.vllm_client import ContextLengthError
from environments.rollout import AssistantTurn, Rollout, TurnBackend, turn_versions

DEFAULT_SYSTEM_PROMPT = (
    "You act in an environment. Each message from the environment is an observation; "
    "reply with your next action. Keep acting until the episode is over.")
DEFAULT_TOOL_SYSTEM_PROMPT = (
    "You act in an environment. Each message from the environment is an observation. "
    "Take an action by calling the tool `{tool}`; its result is the next observation. "
    "Keep acting until the episode is over.")
EVAL_SEED_BASE = 1_000_000_000
"""Training seeds are drawn below it, evaluation seeds are ``EVAL_SEED_BASE + i``."""


class GymEnvError(RuntimeError):
    """The env could not be made, reset or stepped as the settings say."""


# -- where envs come from -------------------------------------------------------------------

def _gem_make(env_id: str) -> Callable[..., Any]:
    try:
        import gem
    except ImportError:
        raise GymEnvError("gym:gem/... needs gem-llm: pip install 'lachesis-rl[gym]' (or "
                          "gem-llm==0.1.0)") from None
    from gem.envs.registration import ENV_REGISTRY

    if env_id not in ENV_REGISTRY:
        near = [k for k in ENV_REGISTRY if env_id.lower().split(":")[-1].split("-")[0]
                in k.lower()][:8]
        raise GymEnvError(f"gym:gem/{env_id}: GEM has no env {env_id!r}"
                          + (f"; similar: {', '.join(near)}" if near else
                             f" ({len(ENV_REGISTRY)} registered, e.g. game:Mastermind-v0-easy)"))
    return lambda **kwargs: gem.make(env_id, **kwargs)


def _gymnasium_make(env_id: str) -> Callable[..., Any]:
    try:
        import gymnasium
    except ImportError:
        raise GymEnvError("gym:gymnasium/... needs gymnasium: pip install "
                          "'lachesis-rl[gym]'") from None
    if env_id not in gymnasium.registry:
        raise GymEnvError(f"gym:gymnasium/{env_id}: gymnasium has no env {env_id!r} "
                          f"(e.g. {', '.join(sorted(gymnasium.registry)[:5])}, ...)")
    return lambda **kwargs: gymnasium.make(env_id, **kwargs)


def _textworld_game(path: str) -> Callable[..., Any]:
    game = Path(path).expanduser()
    if not game.is_file():
        raise GymEnvError(f"gym:textworld/{path}: no such game file {game.resolve()}")
    return lambda **kwargs: TextWorldGame(game, **kwargs)


def _factory(target: str) -> Callable[..., Any]:
    try:
        return load_function(target, f"gym:{target}")
    except ValueError as error:
        raise GymEnvError(str(error)) from None


SOURCES = {"gem": _gem_make, "gymnasium": _gymnasium_make, "textworld": _textworld_game}
"""``gym:SOURCE/NAME``: how each registered source makes its envs."""


def env_factory(spec: str) -> Callable[..., Any]:
    """The callable that makes the env ``gym:SPEC`` names (called with ``make_kwargs``)."""
    source, slash, name = spec.partition("/")
    if slash and source in SOURCES:
        if not name:
            raise GymEnvError(f"gym:{spec}: name the env after {source}/")
        return SOURCES[source](name)
    if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", spec):
        return _factory(spec)
    raise GymEnvError(f"gym:{spec}: use gym:gem/ID, gym:gymnasium/ID, gym:textworld/PATH or "
                      "gym:package.module:FACTORY")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# -- helpers -----------------------------------------------------------------------------------

class EpisodeRandom:
    """An episode's own state of Python's and NumPy's global random generators, swapped
    in around each env call (:meth:`active`)."""

    def __init__(self, seed: int):
        saved = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        self._states = random.getstate(), np.random.get_state()
        random.setstate(saved[0])
        np.random.set_state(saved[1])

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved = random.getstate(), np.random.get_state()
        random.setstate(self._states[0])
        np.random.set_state(self._states[1])
        try:
            yield
        finally:
            self._states = random.getstate(), np.random.get_state()
            random.setstate(saved[0])
            np.random.set_state(saved[1])


@contextlib.contextmanager
def network_blocked() -> Iterator[list[str]]:
    """No connections over IP while inside: each attempt raises ``OSError`` and its
    host is recorded in the list yielded."""
    attempts: list[str] = []
    getaddrinfo, connect = socket.getaddrinfo, socket.socket.connect

    def refuse_lookup(host, port, *args, **kwargs):
        attempts.append(str(host))
        raise OSError(f"network blocked: {host}:{port}")

    def refuse_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(str(address[0]))
            raise OSError(f"network blocked: {address}")
        return connect(sock, address)

    socket.getaddrinfo, socket.socket.connect = refuse_lookup, refuse_connect
    try:
        yield attempts
    finally:
        socket.getaddrinfo, socket.socket.connect = getaddrinfo, connect


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _brief(error: BaseException, limit: int = 400) -> str:
    """An exception's message on one line (NLTK's come framed in lines of asterisks)."""
    text = " ".join(str(error).replace("*", " ").split())
    return text if len(text) <= limit else text[:limit] + " ..."


def discrete_range(env: Any) -> tuple[int, int] | None:
    """``(start, n)`` of a gymnasium ``Discrete`` action space, else None."""
    space = getattr(env, "action_space", None)
    if type(space).__name__ == "Discrete" and hasattr(space, "n"):
        return int(getattr(space, "start", 0)), int(space.n)
    return None


# -- settings ----------------------------------------------------------------------------------

class GymConfig(DemonstratorConfig):
    """Settings of a Gymnasium-style env played through Lachesis (``gym:SPEC`` sets
    ``spec``), and of its demonstrator (:mod:`environments.adapters.gym_demonstrator`)."""

    max_turns: int = Field(default=16, ge=1)
    """Assistant turns (env steps, at most) per episode; reaching it truncates."""
    spec: str = ""
    """What ``gym:SPEC`` names: ``gem/ID``, ``gymnasium/ID``, ``textworld/PATH`` or
    ``package.module:FACTORY``."""
    make_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the env's constructor (``gem.make``, ``gymnasium.make``,
    :class:`TextWorldGame`, the factory)."""
    action_mode: Literal["text", "tool"] = "text"
    """``text``: the reply is the action; ``tool``: the arguments of one call of
    ``tool_name``."""
    action_type: Literal["auto", "text", "int"] = "auto"
    """What ``step`` gets: ``text`` (a string), ``int`` (an integer in the range of a
    ``Discrete`` action space, read as the last integer of a text reply); ``auto``:
    ``int`` for a ``Discrete`` action space, else ``text``."""
    action_pattern: str | None = None
    """A regular expression: with it, a text action is the first group (or the whole
    match) of its last match in the reply; a reply without a match is not a valid action.
    None: the whole reply, stripped."""
    tool_name: str = "act"
    """The model's tool in ``action_mode: tool``."""
    system_prompt: str | None = None
    """The system message (``{tool}`` is replaced by ``tool_name``; "" for none). None: a
    short instruction for the action mode."""
    history: Literal["full", "window"] = "full"
    """``full``: the whole conversation is the context. ``window``: the system prompt, the
    first observation and the last ``window_turns`` turns; past that, each turn starts a new
    segment (trained as its own row)."""
    window_turns: int = Field(default=4, ge=1)
    """Turns (action and observation) a ``window`` keeps."""
    admissible_key: str | None = "admissible_commands"
    """The ``info`` key listing the actions the env admits now (shown after the
    observation when present); None: never shown."""
    info_text_keys: list[str] = Field(default_factory=lambda: ["suffix"])
    """``info`` entries (strings) appended to the observation when present (GEM puts its
    prompt's closing line, e.g. "Enter your guess.", in ``suffix``)."""
    reward_scale: float = 1.0
    """Each turn's score is its step's reward times this."""
    invalid_action_score: float = 0.0
    """The score of a turn whose action the env could not be given."""
    outcome: Literal["last_reward", "success"] = "last_reward"
    """The last turn's score: its step's reward, or 1.0/0.0 for success."""
    success_info_key: str | None = None
    """The ``info`` flag of the last step that says the episode succeeded (``won``). None:
    it succeeded when the env terminated it (not truncated) with a positive reward."""
    eval_seed_base: int = Field(default=EVAL_SEED_BASE, ge=1)
    """Evaluation items are seeds ``eval_seed_base + i``; training seeds are drawn from
    ``[0, eval_seed_base)``: the two never meet."""
    offline_check: bool = True
    """At start, make and reset the env once with the network blocked, so one that needs a
    download at run time fails there, naming it."""


# -- the episode -----------------------------------------------------------------------------

class GymEpisode:
    """One env instance, its RNG state, and turning observations and actions into text."""

    def __init__(self, env: Any, config: GymConfig, seed: int,
                 formatter: Callable[[GymEpisode, str], str] | None = None):
        self.env, self.config, self.seed = env, config, seed
        self.formatter = formatter
        """``formatter(episode, text)``: the message of an observation whose text is
        ``text`` (``episode.info`` holds its info); None: :meth:`format`."""
        self.random = EpisodeRandom(seed)
        self.discrete = discrete_range(env)
        kind = config.action_type
        self.int_actions = kind == "int" or (kind == "auto" and self.discrete is not None)
        if kind == "int" and self.discrete is None:
            raise GymEnvError(f"action_type int needs a Discrete action space; the env's is "
                              f"{getattr(env, 'action_space', None)!r}")
        self.pattern = re.compile(config.action_pattern) if config.action_pattern else None
        self.info: dict[str, Any] = {}
        self.rewards: list[float] = []
        self.terminated = self.truncated = False
        self.invalid_actions = 0

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    def reset(self) -> str:
        with self.random.active():
            accepts_seed = _takes_seed(self.env.reset)
            result = self.env.reset(seed=self.seed) if accepts_seed else self.env.reset()
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            observation, self.info = result
        else:
            observation, self.info = result, {}
        return self.observation_text(observation)

    def step(self, action: Any) -> tuple[str, float]:
        with self.random.active():
            result = self.env.step(action)
        if not isinstance(result, tuple) or len(result) not in (4, 5):
            raise GymEnvError(f"step returned {type(result).__name__}, not (observation, "
                              "reward, terminated, truncated, info)")
        if len(result) == 5:
            observation, reward, terminated, truncated, info = result
        else:  # the older gym API
            observation, reward, terminated, info = result
            truncated = bool(info.get("TimeLimit.truncated", False)) if isinstance(info, dict) \
                else False
        self.info = info if isinstance(info, dict) else {}
        self.terminated, self.truncated = bool(terminated), bool(truncated)
        reward = float(reward or 0.0)
        if not np.isfinite(reward):
            raise GymEnvError(f"step returned a non-finite reward {reward!r}")
        self.rewards.append(reward)
        return self.observation_text(observation), reward

    def observation_text(self, observation: Any) -> str:
        if isinstance(observation, str):
            text = observation
        elif getattr(self.env, "render_mode", None) == "ansi":
            with self.random.active():
                text = _ANSI.sub("", str(self.env.render()))  # Taxi colours its map
        else:
            text = json.dumps(_jsonable(observation), ensure_ascii=False, default=str)
        return (self.formatter or GymEpisode.format)(self, text)

    def format(self, text: str) -> str:
        """The observation's text, the ``info_text_keys`` entries, the admissible actions."""
        parts = [text.rstrip()]
        for key in self.config.info_text_keys:
            if isinstance(self.info.get(key), str) and self.info[key].strip():
                parts.append(self.info[key].strip())
        admissible = self.info.get(self.config.admissible_key) \
            if self.config.admissible_key else None
        if isinstance(admissible, (list, tuple)) and admissible and not self.done:
            parts.append("Admissible commands: " + "; ".join(map(str, admissible)))
        return "\n\n".join(p for p in parts if p)

    def action_from_text(self, text: str) -> tuple[Any, str | None]:
        """``(action, None)`` or ``(None, why it is not an action)``."""
        if self.pattern is not None:
            matches = list(self.pattern.finditer(text))
            if not matches:
                return None, f"no action found (expected a match of {self.pattern.pattern!r})"
            text = matches[-1].group(1) if self.pattern.groups else matches[-1].group(0)
        text = text.strip()
        if not self.int_actions:
            return text, None
        return self.int_action(re.findall(r"-?\d+", text)[-1:] or [None])

    def int_action(self, values: list[Any]) -> tuple[Any, str | None]:
        start, n = self.discrete
        value = values[0]
        try:
            action = int(value)
        except (TypeError, ValueError):
            return None, f"the action must be an integer from {start} to {start + n - 1}"
        if not start <= action < start + n:
            return None, f"the action {action} is not between {start} and {start + n - 1}"
        return action, None

    def tool_schema(self) -> dict[str, Any]:
        if self.int_actions:
            start, n = self.discrete
            parameter = {"type": "integer", "description":
                         f"the action, an integer from {start} to {start + n - 1}"}
        else:
            parameter = {"type": "string", "description": "the action"}
        return {"type": "function", "function": {
            "name": self.config.tool_name, "description": "Take one step in the environment.",
            "parameters": {"type": "object", "properties": {"action": parameter},
                           "required": ["action"]}}}

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()


def _takes_seed(function: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "seed" or p.kind is p.VAR_KEYWORD for p in parameters)


async def run_gym_episode(backend: TurnBackend, renderer: ChatRenderer, episode: GymEpisode,
                          messages: list[dict[str, Any]], *, parser: ToolCallParser,
                          max_turns: int, max_token_length: int,
                          max_tokens_per_turn: int | None,
                          policy_version: Callable[[], int | None] | None = None) -> Rollout:
    """Play ``episode`` from ``messages`` (the system prompt and the first observation) and
    return the trajectory; ``rollout.extra["turn_rewards"]`` holds each turn's step reward
    (None: no step taken). Tokens are built as in the agent loop: sampled ids as returned,
    the observations and the next generation prompt as context."""
    config = episode.config
    tool_mode = config.action_mode == "tool"
    schemas = [episode.tool_schema()] if tool_mode else None
    state = Rollout(messages=[dict(m) for m in messages], tools=schemas,
                    trainable=backend.trainable)
    prompt = renderer.prompt_ids(state.messages, schemas)
    if len(prompt) >= max_token_length:
        raise GymEnvError(f"the first observation's prompt has {len(prompt)} tokens; "
                          f"max_token_length is {max_token_length}")
    state.append(prompt, sampled=False)
    state.n_prompt_tokens = len(prompt)
    n_head = len(messages)  # what a window always keeps
    turn_starts: list[int] = []  # where each turn's messages begin in state.messages
    rewards: list[float | None] = []
    undo = None
    for turn_index in range(max_turns):
        budget = max_token_length - len(state.context)
        max_tokens = min(budget, max_tokens_per_turn or budget)
        version = policy_version() if policy_version else None
        asked = time.monotonic()
        try:
            generated = await backend.generate(state, max_tokens)
        except ContextLengthError:
            if undo is None:
                raise
            n_tokens, n_messages, n_starts = undo
            del state.tokens[n_tokens:], state.masks[n_tokens:], state.logprobs[n_tokens:]
            del state.messages[n_messages:], state.segment_starts[n_starts:]
            if "segments" in state.extra:
                del state.extra["segments"][n_starts + 1:]
            state.truncated, state.stop = True, "max_tokens"
            break
        state.generation_seconds += time.monotonic() - asked
        start = len(state.tokens)
        state.append(generated.token_ids, sampled=True, logprobs=generated.logprobs)
        turn_starts.append(len(state.messages))
        assistant: dict[str, Any] = {"role": "assistant", "content": generated.text}
        parsed = calls = None
        if tool_mode:
            parsed = generated.parsed or parser.parse(generated.text)
            calls = parsed.calls
            if calls:
                assistant["tool_calls"] = [c.model_dump() for c in to_message_tool_calls(calls)]
        state.messages.append(assistant)
        version, spans = turn_versions(generated, start, version)
        turn = AssistantTurn((start, len(state.tokens)), generated.finish_reason,
                             calls or [], [f"malformed tool call: {e}" for e in
                                           (parsed.errors if parsed else [])],
                             version, generated.text, version_spans=spans)
        state.turns.append(turn)
        rewards.append(None)
        if generated.finish_reason == "length" or len(state.context) >= max_token_length:
            state.truncated, state.stop = True, "max_tokens"
            break
        if tool_mode and not calls and not parsed.errors:
            state.stop = "answer"
            break

        # the action, the step, the observation
        if tool_mode:
            new_messages, action, problem = [], None, None
            for i, call in enumerate(calls):
                content = None
                if i > 0:
                    content = "Error: one action per turn; this call was not taken"
                elif call.name != config.tool_name:
                    content = f"Error: unknown tool {call.name!r}; call {config.tool_name}"
                else:
                    try:
                        arguments = validate_arguments(
                            schemas[0]["function"]["parameters"], call.arguments)
                        action = arguments["action"]
                    except ToolError as error:
                        content = f"Error: {error}"
                if content is not None:
                    turn.tool_errors.append(content[len("Error: "):])
                    turn.tool_results.append(content)
                    new_messages.append({"role": "tool", "tool_call_id": f"call_{i}",
                                         "name": call.name, "content": content})
            for error in parsed.errors:
                new_messages.append({"role": "tool",
                                     "content": f"Error: malformed tool call: {error}"})
            if action is None:
                problem = "no valid action"
            elif episode.int_actions:
                action, problem = episode.int_action([action])
                if problem:
                    new_messages.insert(0, {"role": "tool", "tool_call_id": "call_0",
                                            "name": config.tool_name,
                                            "content": f"Error: {problem}"})
                    turn.tool_errors.append(problem)
        else:
            action, problem = episode.action_from_text(generated.text)
            new_messages = [] if problem is None else [
                {"role": "user", "content": f"Error: {problem}. No step was taken."}]
        if problem is None:
            observation, reward = episode.step(action)
            rewards[-1] = reward
            if tool_mode:
                turn.tool_results.insert(0, observation)
                new_messages.insert(0, {"role": "tool", "tool_call_id": "call_0",
                                        "name": config.tool_name, "content": observation})
            else:
                new_messages = [{"role": "user", "content": observation}]
        else:
            episode.invalid_actions += 1
        if episode.done:
            state.messages += new_messages
            state.stop = "done"
            break
        if turn_index == max_turns - 1:
            state.messages += new_messages
            state.truncated, state.stop = True, "max_turns"
            break

        undo = (len(state.tokens), len(state.messages), len(state.segment_starts))
        windowed = config.history == "window" and len(turn_starts) > config.window_turns
        if windowed:  # a new segment: the head and the last window_turns turns
            kept = state.messages[:n_head] + state.messages[turn_starts[-config.window_turns]:]
            following = renderer.prompt_ids(kept + new_messages, schemas)
            fits = len(following) < max_token_length
        else:
            continuation = renderer.continuation(state.messages, new_messages, schemas,
                                                 ended_with_eos=generated.ended_with_eos)
            state.prefix_preserving &= continuation.prefix_preserving
            following = continuation.token_ids
            fits = len(following) + len(state.context) < max_token_length
        if not fits:
            state.messages += new_messages
            state.truncated, state.stop = True, "max_tokens"
            break
        state.messages += new_messages
        if windowed:
            segments = state.extra.setdefault("segments", [
                {"start": 0, "reason": "prompt", "messages": n_head}])
            segments.append({"start": len(state.tokens), "reason": f"history window: the "
                             f"last {config.window_turns} turns", "messages": len(state.messages)})
            state.segment_starts.append(len(state.tokens))
        state.append(following, sampled=False)
    state.extra["turn_rewards"] = rewards
    return state


# -- the env -----------------------------------------------------------------------------------

class GymEnv(NoisyDemonstrator, TurnLevelRewardMixin, BaseEnv):
    """A Gymnasium-style env's episodes, one env step per assistant turn, and its ε-noisy
    demonstrator (``oracle_messages``, :class:`NoisyDemonstrator`). Subclasses may
    override :meth:`make_env` (an env for an item), :meth:`make_episode` (also how its
    observations read) and :meth:`first_messages`."""

    name = "gym"
    config_class = GymConfig

    def __init__(self, config: GymConfig | None = None):
        super().__init__(config)
        self._factory: Callable[..., Any] | None = None

    def make_episode(self, item: dict[str, Any]) -> GymEpisode:
        """A new episode of ``item``: its env, seed and observation format."""
        return GymEpisode(self.make_env(item), self.config, item["seed"])

    def make_env(self, item: dict[str, Any]) -> Any:
        """A new env instance for ``item`` (default: the spec's, with ``make_kwargs``)."""
        if self._factory is None:
            self._factory = env_factory(self.config.spec)
        return self._factory(**self.config.make_kwargs)

    def first_messages(self, item: dict[str, Any], observation: str) -> list[dict[str, Any]]:
        """The messages an episode starts from: the system prompt and the first
        observation."""
        config = self.config
        system = config.system_prompt
        if system is None:
            system = DEFAULT_TOOL_SYSTEM_PROMPT if config.action_mode == "tool" \
                else DEFAULT_SYSTEM_PROMPT
        system = system.replace("{tool}", config.tool_name)
        return ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": observation}]

    async def setup(self) -> None:
        """Make and reset the env once (with the network blocked: ``offline_check``); the
        demonstrator's calibration when ``target_success`` is set."""
        item = (await self.eval_items())[0]
        label = f"gym:{self.config.spec}" if self.config.spec else self.name
        guard = network_blocked() if self.config.offline_check else contextlib.nullcontext([])
        with guard as attempts:
            try:
                episode = self.make_episode(item)
                try:
                    episode.reset()
                finally:
                    episode.close()
                error = None
            except GymEnvError:
                raise
            except Exception as caught:  # noqa: BLE001 - reported with what it tried
                error = caught
        if attempts:
            raise GymEnvError(
                f"{label} needs a download at run time: making and resetting it tried to "
                f"reach {', '.join(dict.fromkeys(attempts))}, and this env server does not "
                "download at run time (offline_check). Provide the data beforehand (GEM's "
                "Wordle, Hangman and WordSearch: NLTK's 'words' corpus, and GEM calls "
                "nltk.download anyway) or pick another env"
                + (f"; it then failed with {type(error).__name__}: {_brief(error)}"
                   if error else ""))
        if error is not None:
            raise GymEnvError(f"{label}: making and resetting the env failed: "
                              f"{type(error).__name__}: {_brief(error)}") from error
        await self.setup_demonstrator()

    async def get_next_item(self) -> dict[str, Any]:
        seed = self.rng.randrange(self.config.eval_seed_base)
        return {"id": f"seed-{seed}", "seed": seed}

    async def eval_items(self) -> list[dict[str, Any]]:
        base = self.config.eval_seed_base
        return [{"id": f"seed-{base + i}", "seed": base + i}
                for i in range(self.config.eval_items)]

    async def collect_trajectory(self, item: dict[str, Any], *,
                                 evaluation: bool = False) -> Rollout:
        episode = self.make_episode(item)
        try:
            messages = self.first_messages(item, episode.reset())
            rollout = await run_gym_episode(
                self.eval_backend if evaluation else self.backend, self.renderer, episode,
                messages, parser=self.parser, max_turns=self.config.max_turns,
                max_token_length=self.config.max_token_length,
                max_tokens_per_turn=self.config.max_tokens_per_turn,
                policy_version=lambda: self.policy_version)
        finally:
            episode.close()
        rollout.extra.update(success=self.succeeded(episode), steps=len(episode.rewards),
                             terminated=episode.terminated, env_truncated=episode.truncated,
                             invalid_actions=episode.invalid_actions,
                             episode_return=float(sum(episode.rewards)))
        return rollout

    def succeeded(self, episode: GymEpisode) -> bool:
        key = self.config.success_info_key
        if key is not None:
            return bool(episode.info.get(key, False))
        return episode.terminated and not episode.truncated and bool(episode.rewards) \
            and episode.rewards[-1] > 0

    def compute_turn_rewards(self, item: Any, rollout: Rollout) -> list[float]:
        config = self.config
        scores = [config.invalid_action_score if r is None else r * config.reward_scale
                  for r in rollout.extra["turn_rewards"]]
        if scores and config.outcome == "success":
            scores[-1] = float(rollout.extra["success"])
        return scores

    def rollout_metrics(self, item: Any, rollout: Rollout,
                        scores: float | list[float]) -> dict[str, float]:
        extra = rollout.extra
        return {"success": float(extra["success"]), "episode_return": extra["episode_return"],
                "steps": float(extra["steps"]), "terminated": float(extra["terminated"]),
                "env_truncated": float(extra["env_truncated"]),
                "invalid_actions": float(extra["invalid_actions"])}


def gym_env_class(spec: str) -> type[GymEnv]:
    """The env class of ``lachesis env ... gym:SPEC`` (the ``gym`` env kind): ``spec`` is
    its default, and its name (the groups' ``env``) is ``gym-SPEC`` made safe."""
    if not spec:
        raise ValueError("gym:SPEC needs a spec: gym:gem/ID, gym:gymnasium/ID, "
                         "gym:textworld/PATH or gym:package.module:FACTORY")
    source, slash, name = spec.partition("/")
    if slash and source in SOURCES:
        if not name:
            raise ValueError(f"gym:{spec}: name the env after {source}/")
        if source == "textworld":
            if not Path(name).expanduser().is_file():
                raise ValueError(f"gym:{spec}: no such game file "
                                 f"{Path(name).expanduser().resolve()}")
            name = Path(name).stem
    elif not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", spec):
        raise ValueError(f"gym:{spec}: use gym:gem/ID, gym:gymnasium/ID, gym:textworld/PATH "
                         "or gym:package.module:FACTORY")
    # (the package is imported when the env starts: naming it costs nothing)
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{source}-{name}" if slash else spec).strip("_")
    config_class = create_model("GymConfig", __base__=GymConfig, spec=(str, Field(
        default=spec, description=GymConfig.model_fields["spec"].description)))
    return type("GymEnv", (GymEnv,), {"name": f"gym-{label}"[:200],
                                      "config_class": config_class, "__module__": __name__})
