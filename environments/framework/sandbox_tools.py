"""Sandboxes in environments: one sandbox per rollout, tools bound to it, honest counters.

An env mixes in :class:`SandboxEnvMixin` (before ``BaseEnv``), uses a config that
subclasses :class:`SandboxEnvConfig`, and implements ``sandbox_tools(item, session)``
(the tools of one rollout, bound to its :class:`SandboxSession`) and optionally
``prepare_sandbox(item, sandbox)`` (put the task's files in) and ``finish_sandbox(item,
sandbox, rollout)`` (take what the reward needs out, into ``rollout.extra``, before the
sandbox is removed). Every rollout of a group gets its own sandbox; it is closed when the
rollout ends, whatever happens.

Failures are kept apart from answers. What the agent's code does (a non-zero exit, a
timeout, too much output) is the tool's result, scored like any other. A failure of the
sandbox itself (:class:`SandboxError`: it could not start, the daemon died) fails the
rollout, so its group is dropped and counted in ``groups_failed``: the model is told "sandbox
failure" for that call, but the trajectory is never scored. The counters are in
``describe_stats()["sandbox"]``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import Field

from environments.framework.agent_loop import run_agent_loop
from environments.framework.base import EnvConfig
from environments.framework.tools import Tool, ToolError
from environments.rollout import Rollout
from environments.sandbox import (
    ExecResult,
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxUsageError,
    create_sandbox,
)

log = logging.getLogger(__name__)


class SandboxEnvConfig(EnvConfig):
    """Settings of an env whose rollouts run code in sandboxes."""

    sandbox_backend: Literal["bwrap", "docker", "unsafe_subprocess"] = "bwrap"
    """``bwrap`` (bubblewrap), ``docker`` (a container per rollout) or
    ``unsafe_subprocess`` (no isolation; needs ``sandbox_allow_unsafe``)."""
    sandbox_image: str | None = None
    """docker: the image (default: the one ``python -m environments.sandbox build-image``
    builds)."""
    sandbox_timeout_s: float = Field(default=10.0, gt=0)
    """Wall-clock limit of one command."""
    sandbox_cpu_time_s: int = Field(default=10, ge=1)
    """CPU seconds per process."""
    sandbox_memory_mb: int = Field(default=512, ge=16)
    """Memory limit (bwrap: per process; docker: the container)."""
    sandbox_max_processes: int = Field(default=64, ge=4)
    sandbox_max_output_bytes: int = Field(default=16 * 1024, ge=1024)
    """Output kept per stream of one command; more kills the command."""
    sandbox_network: bool = False
    sandbox_allow_unsafe: bool = False
    tool_output_chars: int = Field(default=2000, ge=100)
    """Tool results longer than this are cut before they go back to the model."""

    def sandbox_config(self) -> SandboxConfig:
        return SandboxConfig(
            backend=self.sandbox_backend, image=self.sandbox_image,
            timeout_s=self.sandbox_timeout_s, cpu_time_s=self.sandbox_cpu_time_s,
            memory_mb=self.sandbox_memory_mb, max_processes=self.sandbox_max_processes,
            max_output_bytes=self.sandbox_max_output_bytes, network=self.sandbox_network,
            allow_unsafe=self.sandbox_allow_unsafe)


@dataclass
class SandboxStats:
    sandboxes: int = 0
    """Sandboxes created (rollouts, plus grading sandboxes)."""
    execs: int = 0
    exec_nonzero_exit: int = 0
    exec_timeouts: int = 0
    exec_output_truncated: int = 0
    refused: int = 0
    """Requests the sandbox refused (a path outside the workspace, a file too large)."""
    sandbox_failures: int = 0
    """The sandbox itself failed; each fails its rollout (never scored)."""
    grading_timeouts: int = 0


class SandboxSession:
    """One rollout's sandbox, as its tools use it: counts, and turns failures into the
    right kind (ToolError for the model; a recorded failure for the env)."""

    def __init__(self, sandbox: Sandbox, stats: SandboxStats, output_chars: int):
        self.sandbox = sandbox
        self.stats = stats
        self.output_chars = output_chars
        self.failure: SandboxError | None = None
        self.executions: list[ExecResult] = []

    def _failed(self, error: SandboxError) -> ToolError:
        self.stats.sandbox_failures += 1
        if self.failure is None:
            self.failure = error
        log.error("sandbox %s failed: %s", self.sandbox.id, error)
        return ToolError("sandbox failure (not your fault); this episode will not be scored")

    async def exec(self, command: str | list[str], **kwargs: Any) -> ExecResult:
        try:
            result = await self.sandbox.exec(command, **kwargs)
        except SandboxUsageError as error:
            self.stats.refused += 1
            raise ToolError(str(error)) from None
        except SandboxError as error:
            raise self._failed(error) from None
        self.stats.execs += 1
        self.stats.exec_timeouts += result.timed_out
        self.stats.exec_output_truncated += result.output_truncated
        self.stats.exec_nonzero_exit += result.exit_code not in (0, None)
        self.executions.append(result)
        return result

    async def write_file(self, path: str, content: str) -> None:
        try:
            await self.sandbox.write_file(path, content)
        except (SandboxUsageError, FileNotFoundError) as error:
            self.stats.refused += 1
            raise ToolError(str(error)) from None
        except SandboxError as error:
            raise self._failed(error) from None

    async def read_file(self, path: str, max_bytes: int | None = None) -> str:
        try:
            data = await self.sandbox.read_file(path, max_bytes=max_bytes)
        except (SandboxUsageError, FileNotFoundError) as error:
            self.stats.refused += 1
            raise ToolError(str(error)) from None
        except SandboxError as error:
            raise self._failed(error) from None
        return data.decode("utf-8", errors="replace")

    def describe(self, result: ExecResult) -> str:
        return result.describe(self.output_chars)


class SandboxEnvMixin:
    """Gives each rollout its own sandbox (mix in before ``BaseEnv``)."""

    config: SandboxEnvConfig

    def __init__(self, config: SandboxEnvConfig | None = None):
        super().__init__(config)
        self.sandbox_stats = SandboxStats()

    # -- hooks -----------------------------------------------------------------------------
    def sandbox_tools(self, item: Any, session: SandboxSession) -> list[Tool]:
        raise NotImplementedError(f"{type(self).__name__} must implement sandbox_tools")

    async def prepare_sandbox(self, item: Any, sandbox: Sandbox) -> None:
        """Put the item's files in a new rollout sandbox."""

    async def finish_sandbox(self, item: Any, sandbox: Sandbox, rollout: Rollout) -> None:
        """Take what the reward needs out of the sandbox (into ``rollout.extra``)."""

    # -- machinery -------------------------------------------------------------------------
    async def new_sandbox(self, **overrides: Any) -> Sandbox:
        """A sandbox with this env's settings, and ``overrides`` of
        :class:`SandboxConfig` fields (e.g. ``image``); counted."""
        try:
            box = await create_sandbox(self.config.sandbox_config(), **overrides)
        except SandboxError:
            self.sandbox_stats.sandbox_failures += 1
            raise
        self.sandbox_stats.sandboxes += 1
        return box

    async def collect_trajectory(self, item: Any, *, evaluation: bool = False) -> Rollout:
        async with await self.new_sandbox() as box:
            session = SandboxSession(box, self.sandbox_stats, self.config.tool_output_chars)
            await self.prepare_sandbox(item, box)
            rollout = await run_agent_loop(
                self.eval_backend if evaluation else self.backend, self.renderer,
                self.prompt_messages(item), tools=self.sandbox_tools(item, session),
                parser=self.parser, max_turns=self.config.max_turns,
                max_token_length=self.config.max_token_length,
                max_tokens_per_turn=self.config.max_tokens_per_turn,
                policy_version=lambda: self.policy_version)
            if session.failure is not None:
                raise SandboxError(f"item {self.item_id(item)}: the rollout's sandbox failed: "
                                   f"{session.failure}")
            rollout.extra["executions"] = len(session.executions)
            await self.finish_sandbox(item, box, rollout)
        return rollout

    def describe_stats(self) -> dict[str, Any]:
        return {**super().describe_stats(), "sandbox": asdict(self.sandbox_stats)}
