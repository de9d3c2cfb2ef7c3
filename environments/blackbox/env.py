"""Black-box agents: train a program that runs its own loop against an OpenAI-compatible
endpoint (a coding CLI, a scaffold), by intercepting its model calls.

For each rollout the env makes a sandbox, puts the task's files in it
(``prepare_sandbox``), registers the rollout with the interception proxy
(:mod:`environments.blackbox.proxy`) and starts the agent inside the sandbox
(``agent_command``) with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` pointing at the proxy's
endpoint for that rollout. Every chat-completions request of the agent is generated
token-in/token-out on vLLM; the proxy records the tokens, logprobs and turn spans. When
the agent exits (or is killed at ``agent_timeout_s``), ``finish_sandbox`` copies out what
grading needs (into ``rollout.extra``) and the env scores the recorded turns like any
other rollout. The agent never sees its reward: grading runs host-side, on files copied
out of the sandbox.

A harness from the catalog (:mod:`environments.blackbox.harnesses`: Pi, Codex, Claude
Code, OpenCode, mini-swe-agent, openai-agents) is picked with ``agent: NAME`` in the
config: its pinned version is installed into the cache at ``start`` (before any rollout),
mounted read-only at ``/opt/harness``, and each rollout writes the harness's config files
(its provider entry at the proxy, the settings against extra requests) into a fresh
``$HOME`` on the sandbox's private ``/tmp``. The harness's environment is the catalog's
for it (plus ``agent_env``): nothing of Lachesis's, no ``PYTHONPATH``.

Hooks (besides ``BaseEnv``'s ``get_next_item`` and the reward hooks)::

    agent_task(item)                     the task text the agent gets ($LACHESIS_TASK)
    agent_command(item)                  the command run in the sandbox   (default: the
                                         reference agent, environments/blackbox/agents/reference_agent.py)
    sandbox_image(item)                  docker: the image of this item   (default: config)
    prepare_sandbox(item, sandbox)       put the task's files in
    finish_sandbox(item, sandbox, rollout)
                                         take out what grading needs

A rollout fails (its group is dropped, counted and logged with its item id, never scored;
the run goes on) when the agent runs past ``agent_timeout_s``, exits non-zero without
having hit a proxy limit, never called the model, or one of its model calls failed (vLLM,
or an error in the proxy).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from environments.blackbox.agents.runtime import (
    LAUNCHER,
    MOUNT,
    REFERENCE_AGENT,
    build_runtime,
    check_sandbox_python,
    runtime_env,
)
from environments.blackbox.harness_cache import check_reachable, install, install_hint
from environments.blackbox.harnesses import (
    HARNESS_MOUNT,
    HARNESSES,
    HOME_SEED,
    SANDBOX_HOME,
    Harness,
    HarnessError,
    RolloutSpec,
    write_seed,
)
from environments.framework.sandbox_tools import SandboxEnvConfig, SandboxEnvMixin
from environments.rollout import Rollout
from environments.sandbox import SandboxError

log = logging.getLogger(__name__)

SOCKET_DIR = "/run/lachesis"
"""Where the proxy's socket directory appears inside sandboxes."""
AGENT_PORT = 8765
"""The loopback port of the model endpoint inside sandboxes."""
DEFAULT_MAX_OUTPUT_TOKENS = 1024
"""What a harness is told to ask for per reply when ``max_tokens_per_turn`` is not set."""
HARNESS_MAX_TOKEN_LENGTH = 32768
"""``max_token_length``'s default with a catalog ``agent``."""
TAIL_CHARS = 500
"""How much of the agent's stdout and stderr an :class:`AgentError` quotes."""

AgentName = Literal["command", "pi", "codex", "claude-code", "opencode", "mini-swe-agent",
                    "openai-agents", "gemini-cli", "hermes", "qwen-code",
                    "kimi-code", "kilo", "openclaw", "aider"]


class AgentError(RuntimeError):
    """The agent run cannot be scored (it hung, crashed, or never called the model)."""


def _tail(text: str, chars: int = TAIL_CHARS) -> str:
    text = text.strip()
    return repr(text if len(text) <= chars else "..." + text[-chars:])


def describe_run(rollout: Any, result: Any) -> str:
    """What an agent run did, for an error message: its model calls (how many, their
    HTTP statuses when the proxy recorded them), the paths the proxy did not serve, and
    the tails of its stdout and stderr (harnesses report on either)."""
    requests = getattr(rollout, "requests", 0)
    statuses = list(getattr(rollout, "statuses", []) or [])
    unserved = list(getattr(rollout, "unserved", []) or [])
    calls = f"it made {requests} model call{'s' if requests != 1 else ''}"
    if statuses:
        calls += f" (HTTP {', '.join(map(str, statuses))})"
    if unserved:
        calls += f"; requests the proxy does not serve: {', '.join(unserved)}"
    return (f"{calls}; stdout: {_tail(result.stdout)}; stderr: {_tail(result.stderr)}")


@dataclass
class AgentStats:
    runs: int = 0
    timeouts: int = 0
    """Agents killed at ``agent_timeout_s`` (their rollouts failed)."""
    crashes: int = 0
    """Agents that exited non-zero without a proxy limit (their rollouts failed)."""
    no_model_calls: int = 0
    limit_exits: int = 0
    """Agents that stopped because the proxy refused a request for a limit (scored,
    flagged truncated)."""
    new_segments: int = 0
    """Requests whose history did not extend the recorded one."""
    refused_requests: int = 0
    """Requests the proxy refused (malformed, or past a limit), summed over rollouts."""
    abandoned_replies: int = 0
    """Replies the agent never saw (its client gave up and sent the request again): kept
    in the trajectory's metadata, not trained."""
    refused_without_rollout: int = 0
    """Requests the proxy refused before it knew their rollout (malformed HTTP, an
    unknown rollout or path)."""


class BlackBoxEnvConfig(SandboxEnvConfig):
    """Settings of an env whose rollouts are runs of an agent program."""

    agent_timeout_s: float = Field(default=600.0, gt=0)
    """Wall-clock limit of one agent run; past it the agent is killed and the rollout
    fails (not scored)."""
    max_turns: int = Field(default=16, ge=1)
    """Model calls per rollout at most; further calls are refused (HTTP 400) and the
    rollout is flagged truncated."""
    max_token_length: int = Field(default=4096, ge=8)
    """Tokens per trajectory segment at most (prompt included). It must fit the vLLM
    servers' ``max_model_len`` (checked at start); a request whose context reaches it is
    refused (400 ``context_length_exceeded``) and the rollout ends truncated, scored. With a
    catalog ``agent`` the default is :data:`HARNESS_MAX_TOKEN_LENGTH` (32768): harnesses'
    first requests are long (Claude Code's system prompt and tools are ~83 KB of text,
    about 20k tokens with a Qwen tokenizer; docs/harnesses.md)."""
    sandbox_cpu_time_s: int = Field(default=600, ge=1)
    """CPU seconds per process (the agent is one long-lived process)."""
    sandbox_memory_mb: int = Field(default=2048, ge=16)
    """Memory limit of the agent's sandbox (bwrap: address space per process; docker: the
    container). With a catalog ``agent`` the default is raised to what the harness needs
    (Node and Bun reserve a lot of address space), and a smaller value set here is
    refused."""
    agent: AgentName = "command"
    """The agent program: ``command`` (the env's ``agent_command``, by default the
    reference agent) or a harness of the catalog (``pi``, ``codex``, ``claude-code``,
    ``opencode``, ``mini-swe-agent``, ``openai-agents``, ``gemini-cli``, ``hermes``,
    ``qwen-code``, ``kimi-code``, ``kilo``, ``openclaw``, ``aider``; see
    docs/harnesses.md), installed at its pinned version on first use and run with the
    config that points it at the proxy."""
    harness_compaction: bool = False
    """Leave a catalog harness's own context compaction on (off by default; what each one
    does: docs/harnesses.md). A compaction rewrites the history the harness sends: the
    request after it does not extend the recorded conversation, so it starts a new
    segment, and each segment trains as its own row with the rollout's advantage. The
    summarisation request is a model call like any other: a recorded, trained turn (the
    policy wrote the summary the episode goes on from)."""
    agent_env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of the agent (e.g. ``AGENT_STREAM: "1"``); they win
    over the catalog's."""
    scripted_turns: list[str] = Field(default_factory=list)
    """The text of each rollout's first turns (in the model's own format, e.g. a Hermes
    ``<tool_call>`` block), forced token by token instead of sampled; vLLM still records
    the policy's own logprobs of them, so ``lachesis train --check`` passes
    (:mod:`environments.inference.forced_tokens`). A scripted episode (a tool call the
    harness runs in the sandbox, then an answer) for smoke tests of a harness with a
    random model; not for learning (forced tokens are not the policy's samples)."""

    @model_validator(mode="after")
    def _harness_memory(self) -> BlackBoxEnvConfig:
        if self.agent == "command":
            return self
        harness = HARNESSES[self.agent]
        if "max_token_length" not in self.model_fields_set:
            self.max_token_length = max(self.max_token_length, HARNESS_MAX_TOKEN_LENGTH)
        if "sandbox_memory_mb" not in self.model_fields_set:
            self.sandbox_memory_mb = max(self.sandbox_memory_mb, harness.memory_mb)
        elif self.sandbox_memory_mb < harness.min_memory_mb:
            raise ValueError(
                f"agent: {self.agent} needs sandbox_memory_mb of {harness.min_memory_mb} at "
                f"least (it does not start under less; {harness.memory_mb} by default), not "
                f"{self.sandbox_memory_mb}")
        return self


class BlackBoxEnvMixin(SandboxEnvMixin):
    """Runs an agent program per rollout (mix in before ``BaseEnv``)."""

    config: BlackBoxEnvConfig

    def __init__(self, config: BlackBoxEnvConfig | None = None):
        super().__init__(config)
        self.agent_stats = AgentStats()
        self.proxy = None
        self._socket_dir: Path | None = None
        self._runtime: Path | None = None
        self._checked_images: set[str | None] = set()
        self._harness: Harness | None = None
        self._harness_dir: Path | None = None

    def agent_task(self, item: Any) -> str:
        """The task text handed to the agent (environment variable ``LACHESIS_TASK``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement agent_task")

    def agent_command(self, item: Any) -> list[str]:
        """The agent's command line inside the sandbox (run in ``/workspace``). Default:
        the reference agent under the sandbox's ``python3``."""
        return ["python3", REFERENCE_AGENT]

    def sandbox_image(self, item: Any) -> str | None:
        """docker: the image of ``item``'s sandbox (default: ``sandbox_image`` of the
        config)."""
        return self.config.sandbox_image

    # -- machinery -------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to vLLM (``BaseEnv.start``), build the agent runtime, start the proxy."""
        from environments.blackbox.proxy import InterceptionProxy
        from environments.inference.backends import VLLMBackend

        await super().start()
        if not isinstance(self.backend, VLLMBackend):
            raise ValueError("black-box envs record tokens from vLLM: set inference: vllm")
        await self._install_harness()
        self._runtime = build_runtime()
        self._socket_dir = Path(tempfile.mkdtemp(prefix="lachesis-proxy-"))
        self._socket_dir.chmod(0o755)
        c = self.config
        self.proxy = InterceptionProxy(
            self.backend, self.parser, max_turns=c.max_turns,
            max_token_length=c.max_token_length, max_tokens_per_turn=c.max_tokens_per_turn,
            model_name=self._pool.model or "policy", policy_version=lambda: self.policy_version,
            scripted_turns=c.scripted_turns)
        await self.proxy.start(unix_path=self._socket_dir / "proxy.sock")
        log.info("interception proxy on %s and %s", self.proxy.url, self.proxy.unix_path)

    async def _install_harness(self) -> None:
        """The catalog harness of ``agent``, installed if it is not yet (once per cache;
        concurrent envs wait for each other)."""
        name = self.config.agent
        if name == "command":
            return
        if type(self).agent_command is not BlackBoxEnvMixin.agent_command:
            raise ValueError(f"{type(self).__name__} overrides agent_command and its config "
                             f"names agent: {name}; the harness's command comes from the "
                             "catalog: drop one of them")
        harness = HARNESSES[name]
        try:
            self._harness_dir = await asyncio.to_thread(install, harness, log=log.info)
            if self.config.sandbox_backend == "bwrap" and os.geteuid() == 0:
                check_reachable(self._harness_dir)
        except HarnessError as error:
            raise HarnessError(f"{error}\n(agent: {name}; install it by hand with "
                               f"`{install_hint(harness)}`)") from error
        self._harness = harness
        log.info("agent: harness %s (%s, %s API) from %s", name, harness.spec,
                 harness.wire_api, self._harness_dir)

    async def close(self) -> None:
        if self.proxy is not None:
            await self.proxy.close()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        await super().close()

    def _agent_launch(self, item: Any, rollout: Any, home_dir: Path | None = None
                      ) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """(command, environment, mounts) of one agent run; a catalog harness's files go
        into ``home_dir`` (a new host directory, removed after the run)."""
        proxy = self.proxy
        unsafe = self.config.sandbox_backend == "unsafe_subprocess"  # host network and paths
        mounts = {} if unsafe else {str(self._runtime): MOUNT,
                                    str(self._socket_dir): SOCKET_DIR}
        if unsafe:
            base_url, launcher = proxy.base_url(rollout), [LAUNCHER.replace(MOUNT, str(self._runtime))]
        else:
            base_url = proxy.base_url(rollout, f"http://127.0.0.1:{AGENT_PORT}")
            launcher = [LAUNCHER, "--listen", str(AGENT_PORT),
                        "--socket", f"{SOCKET_DIR}/proxy.sock"]
        if self._harness is not None:
            return self._harness_launch(item, rollout, base_url, launcher, mounts, home_dir)
        if unsafe:
            env = runtime_env(self._runtime)
            command = [a.replace(MOUNT, str(self._runtime)) for a in self.agent_command(item)]
        else:
            env = runtime_env()
            command = ["python3", *launcher, "--", *self.agent_command(item)]
        env.update({"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": rollout.token,
                    "OPENAI_MODEL": proxy.model_name, "LACHESIS_TASK": self.agent_task(item),
                    **self.config.agent_env})
        return command, env, mounts

    def _harness_launch(self, item: Any, rollout: Any, base_url: str, launcher: list[str],
                        mounts: dict[str, str], home_dir: Path | None
                        ) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """A catalog harness: its files written into ``home_dir`` (the seed the launcher
        copies into ``$HOME``), its install and the seed mounted read-only."""
        if home_dir is None:
            raise ValueError("a harness run needs a directory for its files")
        c = self.config
        unsafe = c.sandbox_backend == "unsafe_subprocess"
        seed, home = home_dir / "home", (str(home_dir / "run-home") if unsafe else SANDBOX_HOME)
        spec = RolloutSpec(
            base_url=base_url, token=rollout.token, model=self.proxy.model_name,
            task=self.agent_task(item),
            install_dir=str(self._harness_dir) if unsafe else HARNESS_MOUNT, home=home,
            runtime_dir=str(self._runtime) if unsafe else MOUNT,
            context_window=c.max_token_length,
            max_output_tokens=c.max_tokens_per_turn or DEFAULT_MAX_OUTPUT_TOKENS,
            compaction=c.harness_compaction)
        launch = self._harness.launch(spec)
        write_seed(home_dir, launch.files, launch.stdin)
        inside = str(home_dir) if unsafe else HOME_SEED
        if not unsafe:
            mounts = {**mounts, str(self._harness_dir): HARNESS_MOUNT, str(home_dir): HOME_SEED}
        options = ["--home", f"{inside}/home"]
        if launch.stdin is not None:
            options += ["--stdin", f"{inside}/stdin"]
        command = ["python3", *launcher, *options, "--", *launch.argv]
        env = {**launch.env, "HOME": home, **c.agent_env}
        return command, env, mounts

    async def collect_trajectory(self, item: Any, *, evaluation: bool = False) -> Rollout:
        """One agent run in a fresh sandbox, its model calls recorded by the proxy."""
        item_id = self.item_id(item)
        rollout = self.proxy.open_rollout(self.eval_backend if evaluation else self.backend)
        home_dir = (Path(tempfile.mkdtemp(prefix="lachesis-agent-home-"))
                    if self._harness is not None else None)
        finished = False
        try:
            command, env, mounts = self._agent_launch(item, rollout, home_dir)
            async with await self.new_sandbox(image=self.sandbox_image(item),
                                              ro_mounts=mounts) as box:
                await self._check_runtime(box)
                await self.prepare_sandbox(item, box)
                self.agent_stats.runs += 1
                try:
                    result = await box.exec(command, timeout_s=self.config.agent_timeout_s,
                                            env=env)
                except SandboxError:
                    self.sandbox_stats.sandbox_failures += 1
                    raise
                state = await self.proxy.finish_rollout(rollout)
                finished = True
                self._check_run(item_id, rollout, state, result)
                await self.finish_sandbox(item, box, state)
        finally:
            if not finished:
                await self.proxy.finish_rollout(rollout)
            if home_dir is not None:
                shutil.rmtree(home_dir, ignore_errors=True)
        return state

    async def _check_runtime(self, box: Any) -> None:
        """Once per image, when the default (reference) agent runs: the sandbox's python3
        must be able to import the runtime's packages."""
        image = getattr(box, "image", None)
        if (image in self._checked_images or self.config.sandbox_backend == "unsafe_subprocess"
                or self._harness is not None
                or type(self).agent_command is not BlackBoxEnvMixin.agent_command):
            return
        result = await box.exec(["python3", "--version"], env=runtime_env())
        check_sandbox_python(result.stdout + result.stderr)
        self._checked_images.add(image)

    def _check_run(self, item_id: str, rollout: Any, state: Rollout, result: Any) -> None:
        """Record the run; raise :class:`AgentError` when it must not be scored."""
        stats = self.agent_stats
        stats.new_segments += len(rollout.segments) - 1 if rollout.segments else 0
        stats.refused_requests += rollout.refused
        stats.abandoned_replies += len(rollout.abandoned)
        state.extra["agent"] = {"exit_code": result.exit_code, "seconds": round(result.duration_s, 2),
                                "timed_out": result.timed_out, "requests": rollout.requests,
                                "refused": rollout.refused, "limit": rollout.limit,
                                "stdout_tail": result.stdout[-2000:],
                                "stderr_tail": result.stderr[-2000:]}
        if rollout.failure is not None:
            raise AgentError(f"item {item_id}: a model call failed during the agent run: "
                             f"{rollout.failure}; {describe_run(rollout, result)}")
        if result.timed_out:
            stats.timeouts += 1
            raise AgentError(f"item {item_id}: the agent ran past agent_timeout_s "
                             f"({self.config.agent_timeout_s:g} s) and was killed; "
                             f"{describe_run(rollout, result)}")
        if not state.turns:
            stats.no_model_calls += 1
            what = ("without calling the model" if not rollout.requests else
                    "without a recorded turn (none of its model calls was served)")
            raise AgentError(f"item {item_id}: the agent {result.how_it_ended} {what}; "
                             f"{describe_run(rollout, result)}")
        if result.exit_code != 0:
            if rollout.limit is None:
                stats.crashes += 1
                raise AgentError(f"item {item_id}: the agent {result.how_it_ended}; "
                                 f"{describe_run(rollout, result)}")
            stats.limit_exits += 1

    def to_trajectory(self, item: Any, rollout: Rollout, scores: Any) -> Any:
        trajectory = super().to_trajectory(item, rollout, scores)
        run = {k: v for k, v in rollout.extra.get("agent", {}).items() if not k.endswith("_tail")}
        kept = {key: rollout.extra[key] for key in ("wire_apis", "abandoned_replies",
                                                    "unserved_requests", "dropped_tools")
                if rollout.extra.get(key)}
        trajectory.metadata = {**trajectory.metadata, "agent": run, **kept}
        return trajectory

    def describe_stats(self) -> dict[str, Any]:
        if self.proxy is not None:
            self.agent_stats.refused_without_rollout = self.proxy.refused_without_rollout
        return {**super().describe_stats(), "agent": asdict(self.agent_stats)}
