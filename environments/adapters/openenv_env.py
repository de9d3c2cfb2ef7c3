"""OpenEnv environments (openenv-core 0.3.0): ``lachesis env serve openenv:URL``.

An OpenEnv server (``openenv.core.env_server.create_app`` around an ``Environment``, in a
Docker image, an HF Space or a local process) is played through its WebSocket ``/ws``, the
endpoint openenv's own client uses: one connection is one episode on its own environment
instance, messages are ``{"type": "reset"|"step"|"state"|"close", "data": ...}`` and each
``reset``/``step`` answers ``{"type": "observation", "data": {"observation", "reward",
"done"}}``. (Its plain HTTP ``/reset`` and ``/step`` build a fresh environment per request
and keep no episode, so they cannot be used.)

An episode, run by Lachesis's token-in/token-out agent loop:

* ``reset`` (with ``seed`` = the item's seed and ``reset_args``); the observation is the
  user message after ``system_prompt``;
* the model has one tool, ``step`` (``tool_name``), whose arguments are the server's action
  (its JSON schema from ``GET /schema``, less the ``metadata`` field every action has); a
  call sends ``step`` with those arguments and returns the observation, reward and done
  flag as the tool result. An action the server rejects comes back to the model as a tool
  error;
* the reward of the steps a turn made is that turn's score (``None`` counts 0; a turn
  without a valid call made no step and scores 0); the last turn's score is the outcome;
* ``done`` ends the episode (``stop: done``); so do ``max_turns`` and the token budget (a
  step the last turn took counts for it even when its result no longer fits).

A server at capacity (openenv's ``CAPACITY_REACHED``: ``create_app`` allows one session
unless ``max_concurrent_envs`` says more) is asked again every ``capacity_wait_s`` until
``capacity_timeout_s``: a rollout waits for a free session and is never scored for it
(``capacity_retries`` in the stats). Any other failure (the server unreachable, a reset
that fails, the connection lost mid-episode) fails the rollout, and so drops its group.

The client is plain ``aiohttp``: openenv-core need not be installed next to Lachesis (the
``openenv`` extra installs it, to write or run OpenEnv servers).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from pydantic import Field, create_model

from environments.framework.agent_loop import run_agent_loop
from environments.framework.base import BaseEnv, EnvConfig, TurnLevelRewardMixin
from environments.framework.tools import Tool, ToolError
from environments.rollout import GeneratedTurn, Rollout, TurnBackend

CAPACITY_REACHED = "CAPACITY_REACHED"
"""openenv's ``WSErrorCode`` when every session of the server is taken."""

DEFAULT_SYSTEM_PROMPT = (
    "You act in an environment. Each message from the environment is an observation in "
    "JSON. Take an action by calling the tool `{tool}`; its result is the next observation, "
    "the reward of that action and whether the episode is done. Keep acting until it is done.")


class OpenEnvError(RuntimeError):
    """The OpenEnv server could not be reached, refused a reset, or lost the episode."""


class OpenEnvConfig(EnvConfig):
    """Settings of an OpenEnv server played through Lachesis (``openenv:URL`` sets ``url``)."""

    url: str = ""
    """The server's base URL, e.g. ``http://127.0.0.1:8000`` (its ``/ws`` and ``/schema``)."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """The system message of every episode (``{tool}`` is replaced by ``tool_name``)."""
    reset_args: dict[str, Any] = Field(default_factory=dict)
    """Sent with every ``reset`` besides ``seed``; the server passes on the ones its
    ``reset`` accepts."""
    tool_name: str = "step"
    """The name of the model's one tool (its arguments are the server's action)."""
    step_timeout_s: float = Field(default=120.0, gt=0)
    """How long one reset or step may take before the rollout fails."""
    capacity_wait_s: float = Field(default=0.5, gt=0)
    """Wait between tries while the server is at capacity."""
    capacity_timeout_s: float = Field(default=600.0, gt=0)
    """Give up (the rollout fails) after the server stayed at capacity this long."""


def action_parameters(action_schema: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameters: the action's JSON schema (``/schema``'s ``action``) without
    the ``metadata`` field every openenv ``Action`` carries, which is not the model's."""
    parameters = {key: value for key, value in action_schema.items() if key != "title"}
    properties = dict(parameters.get("properties", {}))
    properties.pop("metadata", None)
    parameters["properties"] = properties
    parameters["required"] = [r for r in parameters.get("required", []) if r != "metadata"]
    parameters["type"] = "object"
    return parameters


@dataclass
class _Episode:
    """One WebSocket session: one episode on its own environment instance."""

    ws: aiohttp.ClientWebSocketResponse
    timeout_s: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    done: bool = False
    rollout: Rollout | None = None
    """The rollout being generated (set at each turn), to file step rewards by turn."""
    turn_rewards: dict[int, float] = field(default_factory=dict)
    steps: int = 0
    failure: BaseException | None = None
    """What broke the session mid-episode (raised after the loop: the rollout fails)."""

    async def request(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Send one message and return the server's answer (``{"type", "data"}``)."""
        try:
            await self.ws.send_str(json.dumps({"type": kind, "data": data}))
        except ConnectionError:
            pass  # a server that refused the session may have closed already: read why
        message = await self.ws.receive(timeout=self.timeout_s)
        if message.type != aiohttp.WSMsgType.TEXT:
            raise OpenEnvError(f"the server ended the session during {kind!r} "
                               f"({message.type.name}: {message.extra or message.data})")
        return json.loads(message.data)

    async def step(self, **action: Any) -> str:
        """The model's tool call: one ``step``; its observation, reward and done as text."""
        async with self.lock:  # several calls in one turn go one after the other
            if self.done:
                raise ToolError("the episode is over; no more steps")
            try:
                reply = await self.request("step", action)
            except (OpenEnvError, aiohttp.ClientError, OSError, TimeoutError) as error:
                self.failure, self.done = error, True  # ends the loop; the rollout fails
                raise
            if reply.get("type") == "error":
                data = reply.get("data", {})
                detail = data.get("errors") or data.get("message")
                raise ToolError(f"the environment refused the action ({data.get('code')}): "
                                f"{json.dumps(detail, ensure_ascii=False, default=str)}")
            if reply.get("type") != "observation":
                self.failure, self.done = OpenEnvError(
                    f"unexpected answer to step: {reply!r}"[:500]), True
                raise self.failure
            result = reply["data"]
            turn = len(self.rollout.turns) - 1 if self.rollout else 0
            reward = result.get("reward")
            self.turn_rewards[turn] = self.turn_rewards.get(turn, 0.0) + float(reward or 0.0)
            self.done = bool(result.get("done"))
            self.steps += 1
            return json.dumps(result, ensure_ascii=False)

    async def close(self) -> None:
        if not self.ws.closed:
            try:
                await self.ws.send_str(json.dumps({"type": "close", "data": {}}))
            except ConnectionError:
                pass
            await self.ws.close()


@dataclass
class _TurnTracking:
    """The backend, telling the episode which rollout (and so which turn) is being sampled."""

    inner: TurnBackend
    episode: _Episode

    @property
    def trainable(self) -> bool:
        return self.inner.trainable

    async def generate(self, state: Rollout, max_tokens: int) -> GeneratedTurn:
        self.episode.rollout = state
        return await self.inner.generate(state, max_tokens)


class OpenEnvEnv(TurnLevelRewardMixin, BaseEnv):
    """An OpenEnv server's episodes, played by the policy through the agent loop."""

    name = "openenv"
    config_class = OpenEnvConfig

    def __init__(self, config: OpenEnvConfig | None = None):
        super().__init__(config)
        if not self.config.url:
            raise ValueError("openenv: set `url` (lachesis env serve openenv:http://HOST:PORT)")
        parts = urlsplit(self.config.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"openenv: url {self.config.url!r} is not http(s)://HOST[:PORT]")
        base = self.config.url.rstrip("/")
        self._schema_url = base + "/schema"
        self._ws_url = ("wss" if parts.scheme == "https" else "ws") + base[len(parts.scheme):] + "/ws"
        self._http: aiohttp.ClientSession | None = None
        self._tool_parameters: dict[str, Any] = {}
        self._tool_description = ""
        self.capacity_retries = 0

    async def setup(self) -> None:
        self._http = aiohttp.ClientSession()
        try:
            async with self._http.get(self._schema_url,
                                      timeout=aiohttp.ClientTimeout(total=30)) as response:
                response.raise_for_status()
                schema = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            raise OpenEnvError(f"cannot read the action schema at {self._schema_url}: "
                               f"{type(error).__name__}: {error}") from error
        action = schema.get("action") if isinstance(schema, dict) else None
        if not isinstance(action, dict):
            raise OpenEnvError(f"{self._schema_url} has no 'action' schema: {schema!r}"[:500])
        self._tool_parameters = action_parameters(action)
        self._tool_description = (action.get("description")
                                  or f"Take one step in the environment ({action.get('title', 'action')}).")

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        await super().close()

    async def get_next_item(self) -> dict[str, Any]:
        seed = self.rng.randrange(2**31)
        return {"id": f"seed-{seed}", "seed": seed}

    async def _open_episode(self, item: dict[str, Any]) -> tuple[_Episode, dict[str, Any]]:
        """A new session, reset; waits while the server is at capacity."""
        config = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.capacity_timeout_s
        while True:
            try:
                ws = await self._http.ws_connect(self._ws_url, max_msg_size=0)
            except (aiohttp.ClientError, OSError) as error:
                raise OpenEnvError(f"cannot open {self._ws_url}: {type(error).__name__}: "
                                   f"{error}") from error
            episode = _Episode(ws, config.step_timeout_s)
            try:
                reply = await episode.request("reset", {**config.reset_args, "seed": item["seed"]})
            except BaseException:
                await episode.close()
                raise
            data = reply.get("data", {})
            if reply.get("type") == "observation":
                return episode, data
            await episode.close()
            if reply.get("type") == "error" and data.get("code") == CAPACITY_REACHED:
                self.capacity_retries += 1
                if loop.time() >= deadline:
                    raise OpenEnvError(f"{config.url} stayed at capacity for "
                                       f"{config.capacity_timeout_s:g} s ({data.get('message')})")
                await asyncio.sleep(config.capacity_wait_s)
                continue
            raise OpenEnvError(f"reset failed: {json.dumps(reply, default=str)[:500]}")

    async def collect_trajectory(self, item: dict[str, Any], *, evaluation: bool = False) -> Rollout:
        episode, first = await self._open_episode(item)
        try:
            step = Tool(self.config.tool_name, self._tool_description, self._tool_parameters,
                        episode.step, timeout_s=self.config.step_timeout_s)
            messages = [
                {"role": "system",
                 "content": self.config.system_prompt.replace("{tool}", self.config.tool_name)},
                {"role": "user", "content": json.dumps(first.get("observation", {}),
                                                       ensure_ascii=False)}]
            backend = self.eval_backend if evaluation else self.backend
            rollout = await run_agent_loop(
                _TurnTracking(backend, episode), self.renderer, messages, tools=[step],
                parser=self.parser, max_turns=self.config.max_turns,
                max_token_length=self.config.max_token_length,
                max_tokens_per_turn=self.config.max_tokens_per_turn,
                policy_version=lambda: self.policy_version,
                episode_done=lambda: episode.done)
        finally:
            await episode.close()
        if episode.failure is not None:
            raise OpenEnvError(f"item {item['id']}: the episode broke off: "
                               f"{type(episode.failure).__name__}: {episode.failure}"
                               ) from episode.failure
        rollout.extra["turn_rewards"] = [episode.turn_rewards.get(k, 0.0)
                                         for k in range(len(rollout.turns))]
        rollout.extra["steps"] = episode.steps
        rollout.extra["done"] = episode.done
        return rollout

    def compute_turn_rewards(self, item: Any, rollout: Rollout) -> list[float]:
        return rollout.extra["turn_rewards"]

    def rollout_metrics(self, item: Any, rollout: Rollout,
                        scores: float | list[float]) -> dict[str, float]:
        return {"episode_return": float(sum(rollout.extra["turn_rewards"])),
                "steps": float(rollout.extra["steps"]),
                "done": float(rollout.extra["done"])}

    def describe_stats(self) -> dict[str, Any]:
        return {**super().describe_stats(), "capacity_retries": self.capacity_retries}


def openenv_env_class(url: str) -> type[OpenEnvEnv]:
    """The env class of ``lachesis env ... openenv:URL``: ``url`` is its default, and its
    name (the groups' ``env``) is ``openenv-HOST_PORT``. The ``openenv`` env kind."""
    if not url.startswith(("http://", "https://")):
        raise ValueError("openenv:URL needs the server's http(s):// URL")
    parts = urlsplit(url)
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", (parts.netloc + parts.path).strip("/")) or "server"
    config_class = create_model("OpenEnvConfig", __base__=OpenEnvConfig, url=(str, Field(
        default=url, description=OpenEnvConfig.model_fields["url"].description)))
    return type("OpenEnvEnv", (OpenEnvEnv,), {
        "name": f"openenv-{label}", "config_class": config_class,
        "__module__": __name__})
