"""Environments of other frameworks, run by Lachesis unchanged.

* :mod:`environments.adapters.verifiers_env`: a verifiers (0.4.0, ``verifiers.v1``)
  taskset, ``lachesis env serve verifiers:ID``;
* :mod:`environments.adapters.openenv_env`: an OpenEnv (openenv-core 0.3.0) server,
  ``lachesis env serve openenv:URL``.

Both run the episode with Lachesis's own token-in/token-out agent loop, so the trajectory
holds the exact tokens the policy sampled, and both give one score per assistant turn
(docs/adapters.md says when those are meaningful).
"""
