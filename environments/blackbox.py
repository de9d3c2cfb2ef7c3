"""Black-box agents: train a program that runs its own loop against an OpenAI-compatible
endpoint (a coding CLI, a scaffold), by intercepting its model calls.

For each rollout the env makes a sandbox, puts the task's files in it
(``prepare_sandbox``), registers the rollout with the interception proxy
(:mod:`environments.inference.proxy`) and starts the agent inside the sandbox
(``agent_command``) with ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` pointing at the proxy's
endpoint for that rollout. Every chat-completions request of the agent is generated
token-in/token-out on vLLM; the proxy records the tokens, logprobs and turn spans. When
the agent exits (or is killed at ``agent_timeout_s``), ``finish_sandbox`` copies out what
grading needs (into ``rollout.extra``) and the env scores the recorded turns like any
other rollout. The agent never sees its reward: grading runs host-side, on files copied
out of the sandbox.

Hooks (besides ``BaseEnv``'s ``get_next_item`` and the reward hooks)::

    agent_task(item)                     the task text the agent gets ($LACHESIS_TASK)
    agent_command(item)                  the command run in the sandbox   (default: the
                                         reference agent, environments/agents/reference_agent.py)
    sandbox_image(item)                  docker: the image of this item   (default: config)
    prepare_sandbox(item, sandbox)       put the task's files in
    finish_sandbox(item, sandbox, rollout)
                                         take out what grading needs

A rollout fails (its group is dropped and counted, never scored) when the agent runs past
``agent_timeout_s``, exits non-zero without having hit a proxy limit, or never called the
model.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from environments.sandbox.tools import SandboxEnvConfig, SandboxEnvMixin


class BlackBoxEnvConfig(SandboxEnvConfig):
    """Settings of an env whose rollouts are runs of an agent program."""

    agent_timeout_s: float = Field(default=600.0, gt=0)
    """Wall-clock limit of one agent run; past it the agent is killed and the rollout
    fails (not scored)."""
    max_turns: int = Field(default=16, ge=1)
    """Model calls per rollout at most; further calls are refused (HTTP 400) and the
    rollout is flagged truncated."""
    max_token_length: int = Field(default=8192, ge=8)
    """Tokens per trajectory segment at most (prompt included)."""


class BlackBoxEnvMixin(SandboxEnvMixin):
    """Runs an agent program per rollout (mix in before ``BaseEnv``)."""

    config: BlackBoxEnvConfig

    def agent_task(self, item: Any) -> str:
        """The task text handed to the agent (environment variable ``LACHESIS_TASK``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement agent_task")

    def agent_command(self, item: Any) -> list[str]:
        """The agent's command line inside the sandbox (run in ``/workspace``)."""
        raise NotImplementedError

    def sandbox_image(self, item: Any) -> str | None:
        """docker: the image of ``item``'s sandbox (default: ``sandbox_image`` of the
        config)."""
        return self.config.sandbox_image
