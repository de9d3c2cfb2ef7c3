"""Black-box agents: any program that talks to an OpenAI-compatible endpoint, run in a
sandbox, with exact tokens recorded by the interception proxy.

* ``env``: :class:`BlackBoxEnvMixin` / :class:`BlackBoxEnvConfig`, the env side (start
  the agent in a sandbox per rollout, collect its trajectory from the proxy);
* ``proxy``: the interception proxy (an OpenAI chat-completions endpoint per rollout);
* ``agents``: the reference agent, the runtime it runs with in a sandbox, and its launch.
"""

from environments.blackbox.env import BlackBoxEnvConfig, BlackBoxEnvMixin

__all__ = ["BlackBoxEnvConfig", "BlackBoxEnvMixin"]
